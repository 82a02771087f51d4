"""The metrics endpoint over real loopback HTTP: httpx as the scraper, prometheus-client's
own parser reading what it serves, raw sockets as the misbehaving clients."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.metrics import (
    CONTENT_TYPE,
    BadListenAddress,
    CollectionTimes,
    LoopStats,
    metrics_registry,
    serve_loop_lag_monitor,
    serve_metrics,
)
from orchestrator.daemon.metrics.endpoint import IDLE_DEADLINE_S
from orchestrator.daemon.run_state import RunState, Shipping

LIMITS = SinkLimits(
    batch_size=4,
    constant_size=False,
    staleness=Staleness(1),
    curriculum_min_mean_reward=0.0,
    curriculum_max_mean_reward=1.0,
    max_seq_len=64,
)
X_1 = "# HELP x x\n# TYPE x gauge\nx 1.0\n"


class Collect:
    """A collector whose `collect` is any function: one gauge `x` by default."""

    def __init__(self, collect: Callable[[], Iterable[Metric]] | None = None) -> None:
        self._collect = collect or (lambda: [GaugeMetricFamily("x", "x", value=1)])

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def registry_of(collector: Collect | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector or Collect())
    return registry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, parsed by prometheus-client: (name, labels) -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in found, key
            found[key] = sample.value
    return found


@asynccontextmanager
async def metrics_server(
    registry: CollectorRegistry, *, sockets: Sequence[socket.socket] = ()
) -> AsyncIterator[tuple[str, int]]:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            partial(serve_metrics, "127.0.0.1:0", registry, sockets=sockets)
        )
        yield address
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def scraper(address: tuple[str, int]) -> AsyncIterator[httpx.AsyncClient]:
    host, port = address
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as client:
        yield client


async def raw_exchange(address: tuple[str, int], data: bytes, *, half_close: bool = True) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it."""
    async with await trio.open_tcp_stream(*address) as stream:
        await stream.send_all(data)
        if half_close:
            await stream.send_eof()
        received = bytearray()
        while chunk := await stream.receive_some(65536):
            received += chunk
        return bytes(received)


def _state() -> RunState:
    return RunState(Staleness(1, 1), Shipping(0))


async def test_a_scraper_sees_counters_change_between_scrapes() -> None:
    state, sink = _state(), TrainSink(LIMITS)
    state.dispatch.rollouts["completed"] = 3
    registry = metrics_registry(state, sink, LoopStats(), CollectionTimes())
    async with metrics_server(registry) as address, scraper(address) as client:
        first = await client.get("/metrics")
        state.dispatch.rollouts["completed"] += 5
        state.payload.files_deleted["collection"] += 40
        state.versions.applied = 2
        second = await client.get("/metrics")

    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["content-type"] == CONTENT_TYPE
        assert response.text.startswith("# HELP orchestrator_")
    before, after = samples(first.text), samples(second.text)
    completed = ("orchestrator_rollouts_total", (("outcome", "completed"),))
    assert (before[completed], after[completed]) == (3, 8)
    deleted = ("orchestrator_payload_files_deleted_total", (("path", "collection"),))
    assert (before[deleted], after[deleted]) == (0, 40)
    assert after[("orchestrator_applied_version", ())] == 2


async def test_the_server_reports_its_bound_loopback_port() -> None:
    async with metrics_server(registry_of()) as (host, port):
        assert host == "127.0.0.1"
        assert port > 0
        stream = await trio.open_tcp_stream(host, port)  # something really listens there
        await stream.aclose()


async def test_sockets_bound_beforehand_are_served_and_closed_at_the_end() -> None:
    # What orchestrator.daemon.preflight hands over: a socket bound and listening already.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    async with metrics_server(registry_of(), sockets=[listener]) as address:
        assert address == ("127.0.0.1", port)
        async with scraper(address) as client:
            assert (await client.get("/metrics")).text == X_1
    assert listener.fileno() == -1


async def test_other_paths_get_404_and_other_methods_405() -> None:
    async with metrics_server(registry_of()) as address, scraper(address) as client:
        missing = await client.get("/")
        nested = await client.get("/metrics/extra")
        posted = await client.post("/metrics", content=b"")
        still_fine = await client.get("/metrics?debug=1")
    assert missing.status_code == 404
    assert nested.status_code == 404
    assert posted.status_code == 405
    assert posted.headers["allow"] == "GET, HEAD"
    assert still_fine.status_code == 200
    assert still_fine.text == X_1


async def test_head_sends_the_headers_of_get_without_a_body() -> None:
    async with metrics_server(registry_of()) as address, scraper(address) as client:
        head = await client.head("/metrics")
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(X_1))
    assert head.content == b""


async def test_one_connection_serves_several_requests() -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
    closing = b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    async with metrics_server(registry_of()) as address:
        reply = await raw_exchange(address, request + request + closing, half_close=False)
    statuses = re.findall(rb"^HTTP/1\.1 (\d{3}) ", reply, flags=re.MULTILINE)
    assert statuses == [b"200", b"200", b"404"]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe garbage \x01\r\n\r\n",
        b"HELLO\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
    ],
)
async def test_a_malformed_request_gets_400_and_the_server_lives_on(garbage: bytes) -> None:
    async with metrics_server(registry_of()) as address:
        reply = await raw_exchange(address, garbage)
        assert reply.startswith(b"HTTP/1.1 400 ")
        async with scraper(address) as client:
            assert (await client.get("/metrics")).text == X_1


async def test_a_request_cut_short_or_too_long_does_not_kill_the_server() -> None:
    async with metrics_server(registry_of()) as address:
        cut = await raw_exchange(address, b"GET /metrics HTTP/1.1\r\nHost: t\r\n")
        assert not cut.startswith(b"HTTP/1.1 200 ")
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 200_000 + b"\r\n\r\n"
        too_long = await raw_exchange(address, huge)
        assert re.match(rb"HTTP/1\.1 4\d\d ", too_long)
        # A client that connects and leaves without a word.
        await (await trio.open_tcp_stream(*address)).aclose()
        async with scraper(address) as client:
            assert (await client.get("/metrics")).status_code == 200


async def test_a_failing_collector_gets_500_and_the_next_scrape_works() -> None:
    calls = 0

    def flaky() -> list[Metric]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in a metric")
        return [GaugeMetricFamily("x", "x", value=1)]

    async with metrics_server(registry_of(Collect(flaky))) as address, scraper(address) as client:
        failed = await client.get("/metrics")
        recovered = await client.get("/metrics")
    assert failed.status_code == 500
    assert recovered.status_code == 200
    assert recovered.text == X_1


async def test_a_stalled_or_idle_connection_is_closed_after_the_idle_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with metrics_server(registry_of()) as address:
        started = trio.current_time()
        stalled = await raw_exchange(address, b"GET /metrics HTT", half_close=False)
        assert stalled == b""
        assert trio.current_time() - started == pytest.approx(IDLE_DEADLINE_S)

        started = trio.current_time()
        request = b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
        reply = await raw_exchange(address, request, half_close=False)
        assert reply.startswith(b"HTTP/1.1 200 ")
        assert trio.current_time() - started == pytest.approx(IDLE_DEADLINE_S)


async def test_bad_listen_addresses_and_busy_ports_are_errors() -> None:
    with pytest.raises(BadListenAddress, match="'nowhere' is not"):
        await serve_metrics("nowhere", registry_of())
    async with metrics_server(registry_of()) as (host, port):
        with pytest.raises(OSError):
            await serve_metrics(f"{host}:{port}", registry_of())


async def test_a_blocked_event_loop_shows_in_the_scraped_lag() -> None:
    stats = LoopStats()
    registry = metrics_registry(_state(), TrainSink(LIMITS), stats, CollectionTimes())
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag_monitor, stats, interval_s=0.005))
        address = await nursery.start(serve_metrics, "127.0.0.1:0", registry)
        # Deliberately block the trio thread, as a synchronous file walk would.
        time.sleep(0.05)  # noqa: ASYNC251
        await trio.sleep(0.02)
        async with scraper(address) as client:
            scraped = samples((await client.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    assert scraped[("orchestrator_event_loop_worst_lag_seconds", ())] >= 0.04
    name = "orchestrator_event_loop_lag_seconds"
    assert scraped[(f"{name}_bucket", (("le", "0.025"),))] < scraped[(f"{name}_count", ())]
