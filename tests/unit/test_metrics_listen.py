"""The `[metrics] listen` address: what it means and what is refused."""

from __future__ import annotations

import pytest

from orchestrator.daemon.metrics import BadListenAddress, parse_listen_address


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:9464", ("::1", 9464)),
        ("localhost:80", ("localhost", 80)),
        (":9464", ("127.0.0.1", 9464)),  # no host: loopback, not every interface
    ],
)
def test_listen_addresses(listen: str, address: tuple[str, int]) -> None:
    assert parse_listen_address(listen) == address


@pytest.mark.parametrize("listen", ["", "9464", "host:", "host:http", "host:65536", "h:-1"])
def test_bad_listen_addresses_are_refused_with_the_value(listen: str) -> None:
    with pytest.raises(BadListenAddress, match=f"{listen!r} is not"):
        parse_listen_address(listen)
