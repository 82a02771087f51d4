"""The endpoint's HTTP, sans I/O: request heads, routing, responses, listen addresses."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator._metrics_http_protocol import (
    HEAD_END,
    MalformedRequest,
    encode_response,
    parse_request_head,
    plain_response,
    route,
)
from orchestrator.metrics import (
    BadListenAddress,
    parse_listen_address,
)


def _head(text: str) -> bytes:
    return text.replace("\n", "\r\n").encode()


def test_a_scrape_request_parses() -> None:
    request = parse_request_head(
        _head("GET /metrics?x=1 HTTP/1.1\nHost: h:9464\nAccept:  text/plain \nX-A: 1")
    )
    assert request.method == "GET"
    assert request.target == "/metrics?x=1"
    assert request.path == "/metrics"
    assert request.version == "HTTP/1.1"
    assert request.header("accept") == "text/plain"
    assert request.header("ACCEPT") == "text/plain"
    assert request.header("missing") is None
    assert request.keep_alive
    assert route(request) is None


def test_bare_line_feeds_are_accepted() -> None:
    request = parse_request_head(b"GET /metrics HTTP/1.0\nUser-Agent: nc")
    assert request.header("user-agent") == "nc"
    assert not request.keep_alive  # HTTP/1.0


@pytest.mark.parametrize(
    ("data", "start", "end"),
    [
        (b"A\r\n\r\nB", 1, 5),
        (b"A\n\nB", 1, 3),
        (b"A\r\nB: c\n\r\nD", 7, 10),
        (b"A\r\nB", None, None),
    ],
)
def test_the_blank_line_ending_a_head_is_found(
    data: bytes, start: int | None, end: int | None
) -> None:
    match = HEAD_END.search(data)
    found = (match.start(), match.end()) if match else (None, None)
    assert found == (start, end)


def test_absolute_form_targets_route_by_path() -> None:
    request = parse_request_head(_head("GET http://h:1/metrics HTTP/1.1\nHost: h"))
    assert request.path == "/metrics"


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        ("", "bad request line"),
        ("GET /metrics", "bad request line"),
        ("GET  /metrics HTTP/1.1\nHost: h", "bad request line"),
        ("GET /metrics HTTP/1.1 extra\nHost: h", "bad request line"),
        ("G(T /metrics HTTP/1.1\nHost: h", "bad method"),
        ("GET /metrics HTTP/2.0\nHost: h", "unsupported protocol"),
        ("GET /metrics SPDY/3\nHost: h", "unsupported protocol"),
        ("GET metrics HTTP/1.1\nHost: h", "bad request target"),
        ("GET /a\x7fb HTTP/1.1\nHost: h", "control character"),
        ("GET http://[::1/metrics HTTP/1.1\nHost: h", "bad request target"),
        ("GET /metrics HTTP/1.1\nHost h", "bad header line"),
        ("GET /metrics HTTP/1.1\nHost : h", "bad header line"),
        ("GET /metrics HTTP/1.1\nHost: h\n folded", "bad header line"),
        ("GET /metrics HTTP/1.1\nX-A: 1", "needs a Host header"),
    ],
)
def test_malformed_heads_are_refused(head: str, problem: str) -> None:
    with pytest.raises(MalformedRequest, match=problem):
        parse_request_head(_head(head))


def test_a_lone_carriage_return_in_a_header_is_refused() -> None:
    with pytest.raises(MalformedRequest, match="control character in header"):
        parse_request_head(b"GET / HTTP/1.1\r\nHost: a\rb")


def test_non_ascii_request_lines_are_refused_but_latin1_header_values_are_not() -> None:
    with pytest.raises(MalformedRequest, match="not ASCII"):
        parse_request_head("GET /métrics HTTP/1.1\r\nHost: h".encode())
    request = parse_request_head("GET / HTTP/1.1\r\nHost: h\r\nX-Name: café".encode("latin-1"))
    assert request.header("x-name") == "café"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        ("GET / HTTP/1.1\nHost: h", HTTPStatus.NOT_FOUND),
        ("GET /metrics/ HTTP/1.1\nHost: h", HTTPStatus.NOT_FOUND),
        ("POST /metrics HTTP/1.1\nHost: h", HTTPStatus.METHOD_NOT_ALLOWED),
        ("HEAD /metrics HTTP/1.1\nHost: h", None),
        ("GET /metrics HTTP/1.0", None),
    ],
)
def test_routing(head: str, status: HTTPStatus | None) -> None:
    assert route(parse_request_head(_head(head))) is status


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        ("GET /metrics HTTP/1.1\nHost: h", True),
        ("GET /metrics HTTP/1.1\nHost: h\nConnection: Keep-Alive, Close", False),
        ("GET /metrics HTTP/1.1\nHost: h\nContent-Length: 5", False),
        ("GET /metrics HTTP/1.1\nHost: h\nContent-Length: 0", True),
        ("GET /metrics HTTP/1.1\nHost: h\nTransfer-Encoding: chunked", False),
        ("GET /metrics HTTP/1.0\nConnection: keep-alive", False),
    ],
)
def test_connections_are_kept_only_when_safe(head: str, keep_alive: bool) -> None:
    assert parse_request_head(_head(head)).keep_alive is keep_alive


def test_responses_carry_length_type_and_connection() -> None:
    response = plain_response(HTTPStatus.NOT_FOUND)
    assert encode_response(response, head_only=False, keep_alive=True) == (
        b"HTTP/1.1 404 Not Found\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 10\r\n"
        b"Connection: keep-alive\r\n"
        b"\r\n"
        b"Not Found\n"
    )
    head = encode_response(response, head_only=True, keep_alive=False)
    assert head.endswith(b"Content-Length: 10\r\nConnection: close\r\n\r\n")


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


@settings(max_examples=200)
@given(
    head=st.one_of(
        st.binary(max_size=120),
        st.lists(
            st.sampled_from(
                [b"GET", b"HEAD", b" ", b"/metrics", b"http://[", b"HTTP/1.1", b"\r\n", b"\n",
                 b"Host: h", b":", b"\r", b"\x00", b"\xff", b"Connection: close"]
            ),
            max_size=12,
        ).map(b"".join),
    )
)  # fmt: skip
def test_any_bytes_parse_or_raise_malformed_request(head: bytes) -> None:
    try:
        request = parse_request_head(head)
    except MalformedRequest as exc:
        assert str(exc)
        return
    # What parses can be routed and answered without raising either.
    route(request)
    assert isinstance(request.keep_alive, bool)
