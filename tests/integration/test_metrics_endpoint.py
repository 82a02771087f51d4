"""The metrics endpoint over real loopback HTTP: httpx as the scraper, raw sockets as the
misbehaving clients."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from orchestrator._metrics_server import IDLE_DEADLINE_S, REQUEST_DEADLINE_S
from orchestrator.metrics import (
    CONTENT_TYPE,
    BadListenAddress,
    LoopStats,
    render_metrics,
    serve_loop_lag_monitor,
    serve_metrics,
    snapshot_from,
)
from orchestrator.run_state import RunState
from orchestrator.sink import SinkLimits, TrainSink

LIMITS = SinkLimits(
    batch_size=4,
    constant_size=False,
    max_off_policy_steps=1,
    curriculum_min_mean_reward=0.0,
    curriculum_max_mean_reward=1.0,
    max_seq_len=64,
)


def sample_value(text: str, line_start: str) -> float:
    """The value of the one sample line starting with `line_start` (name and labels)."""
    values = [line.rpartition(" ")[2] for line in text.splitlines() if line.startswith(line_start)]
    assert len(values) == 1, f"{line_start!r} in:\n{text}"
    return float(values[0])


@asynccontextmanager
async def metrics_server(render: Callable[[], str]) -> AsyncIterator[tuple[str, int]]:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_metrics, "127.0.0.1:0", render)
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
    return RunState(max_off_policy_steps=1, max_async_steps=1, max_steps=0)


async def test_a_scraper_sees_counters_change_between_scrapes() -> None:
    state, sink = _state(), TrainSink(LIMITS)
    state.rollouts["completed"] = 3
    async with (
        metrics_server(lambda: render_metrics(snapshot_from(state, sink))) as address,
        scraper(address) as client,
    ):
        first = await client.get("/metrics")
        state.rollouts["completed"] += 5
        state.files_deleted["collection"] += 40
        state.applied_version = 2
        second = await client.get("/metrics")

    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["content-type"] == CONTENT_TYPE
        assert response.text.startswith("# HELP orchestrator_")
    completed = 'orchestrator_rollouts_total{outcome="completed"}'
    assert sample_value(first.text, completed) == 3
    assert sample_value(second.text, completed) == 8
    deleted = 'orchestrator_payload_files_deleted_total{path="collection"}'
    assert sample_value(first.text, deleted) == 0
    assert sample_value(second.text, deleted) == 40
    assert sample_value(second.text, "orchestrator_applied_version ") == 2


async def test_the_server_reports_its_bound_loopback_port() -> None:
    async with metrics_server(lambda: "") as (host, port):
        assert host == "127.0.0.1"
        assert port > 0
        stream = await trio.open_tcp_stream(host, port)  # something really listens there
        await stream.aclose()


async def test_other_paths_get_404_and_other_methods_405() -> None:
    async with metrics_server(lambda: "x 1\n") as address, scraper(address) as client:
        missing = await client.get("/")
        nested = await client.get("/metrics/extra")
        posted = await client.post("/metrics", content=b"")
        still_fine = await client.get("/metrics?debug=1")
    assert missing.status_code == 404
    assert nested.status_code == 404
    assert posted.status_code == 405
    assert posted.headers["allow"] == "GET, HEAD"
    assert still_fine.status_code == 200
    assert still_fine.text == "x 1\n"


async def test_head_sends_the_headers_of_get_without_a_body() -> None:
    async with metrics_server(lambda: "x 1\n") as address, scraper(address) as client:
        head = await client.head("/metrics")
    assert head.status_code == 200
    assert head.headers["content-length"] == "4"
    assert head.content == b""


async def test_one_connection_serves_several_requests() -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
    closing = b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    async with metrics_server(lambda: "x 1\n") as address:
        reply = await raw_exchange(address, request + request + closing, half_close=False)
    statuses = re.findall(rb"^HTTP/1\.1 (\d{3}) ", reply, flags=re.MULTILINE)
    assert statuses == [b"200", b"200", b"404"]
    assert reply.count(b"Connection: keep-alive") == 2
    assert reply.count(b"Connection: close") == 1


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe garbage \x01\r\n\r\n",
        b"HELLO\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
        b"GET /metrics HTTP/9.9\r\nHost: t\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
    ],
)
async def test_a_malformed_request_gets_400_and_the_server_lives_on(garbage: bytes) -> None:
    async with metrics_server(lambda: "x 1\n") as address:
        reply = await raw_exchange(address, garbage)
        assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"Connection: close\r\n" in reply
        async with scraper(address) as client:
            assert (await client.get("/metrics")).text == "x 1\n"


async def test_a_request_cut_short_or_too_long_does_not_kill_the_server() -> None:
    async with metrics_server(lambda: "x 1\n") as address:
        cut = await raw_exchange(address, b"GET /metrics HTTP/1.1\r\nHost: t\r\n")
        assert cut.startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
        too_long = await raw_exchange(address, huge)
        assert too_long.startswith(b"HTTP/1.1 431 ")
        # A client that connects and leaves without a word.
        assert await raw_exchange(address, b"") == b""
        async with scraper(address) as client:
            assert (await client.get("/metrics")).status_code == 200


async def test_a_failing_render_gets_500_and_the_next_scrape_works() -> None:
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in a metric")
        return "x 1\n"

    async with metrics_server(flaky) as address, scraper(address) as client:
        failed = await client.get("/metrics")
        recovered = await client.get("/metrics")
    assert failed.status_code == 500
    assert recovered.status_code == 200
    assert recovered.text == "x 1\n"


async def test_a_stalled_request_is_dropped_after_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with metrics_server(lambda: "x 1\n") as address:
        started = trio.current_time()
        reply = await raw_exchange(address, b"GET /metrics HTT", half_close=False)
        assert reply == b""
        assert trio.current_time() - started == pytest.approx(REQUEST_DEADLINE_S)


async def test_an_idle_connection_is_closed_after_the_idle_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with metrics_server(lambda: "x 1\n") as address:
        started = trio.current_time()
        request = b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
        reply = await raw_exchange(address, request, half_close=False)
        assert reply.startswith(b"HTTP/1.1 200 OK\r\n")
        assert trio.current_time() - started == pytest.approx(IDLE_DEADLINE_S)


async def test_bad_listen_addresses_and_busy_ports_are_errors() -> None:
    with pytest.raises(BadListenAddress, match="'nowhere' is not"):
        await serve_metrics("nowhere", lambda: "")
    async with metrics_server(lambda: "") as (host, port):
        with pytest.raises(OSError):
            await serve_metrics(f"{host}:{port}", lambda: "")


async def test_a_blocked_event_loop_shows_in_the_scraped_lag() -> None:
    stats = LoopStats()
    state, sink = _state(), TrainSink(LIMITS)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag_monitor, stats, interval_s=0.005))
        address = await nursery.start(
            serve_metrics, "127.0.0.1:0", lambda: render_metrics(snapshot_from(state, sink, stats))
        )
        # Deliberately block the trio thread, as a synchronous file walk would.
        time.sleep(0.05)  # noqa: ASYNC251
        await trio.sleep(0.02)
        async with scraper(address) as client:
            text = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    assert sample_value(text, "orchestrator_event_loop_worst_lag_seconds ") >= 0.04
    assert sample_value(text, 'orchestrator_event_loop_lag_seconds_bucket{le="0.025"}') < (
        sample_value(text, "orchestrator_event_loop_lag_seconds_count ")
    )
