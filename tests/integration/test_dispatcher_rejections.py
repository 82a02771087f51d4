"""Every rejection of the dispatcher goes through `Dispatch.rejections`: a server that
answers garbage to every request is counted per request, not asked again (it would answer
the same), and logged at warning level with its reason at once, then once per interval.
A real server on 127.0.0.1 answers."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import pytest
import structlog.testing
import trio

from orchestrator.config import load_config
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.inference.client import encode_generate_request
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.rollout_runner import RolloutRunner
from orchestrator.daemon.run_state import RunState, Shipping
from orchestrator.wire import InferenceFailure, build_generate_request

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
GARBAGE = b"<html>502 from a proxy, not JSON</html>"
TURNS = 30
RETRIES = 3


async def answer_garbage(stream: trio.SocketStream) -> None:
    """Answer every request on the connection with 200 and a body that is not JSON."""
    connection = h11.Connection(h11.SERVER)
    with contextlib.suppress(trio.BrokenResourceError, h11.RemoteProtocolError):
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                connection.receive_data(data)
            elif isinstance(event, h11.EndOfMessage):
                headers = [
                    ("content-type", "application/json"),
                    ("content-length", str(len(GARBAGE))),
                ]
                reply = connection.send(h11.Response(status_code=200, headers=headers))
                reply += connection.send(h11.Data(data=GARBAGE))
                reply += connection.send(h11.EndOfMessage())
                await stream.send_all(reply)
                connection.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return


@contextlib.asynccontextmanager
async def garbage_server() -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, answer_garbage, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def failure_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "rollout failure"]


async def test_a_server_answering_garbage_is_counted_not_retried_and_logged_once(
    tmp_path: Path,
) -> None:
    config = load_config(
        DEMO,
        [
            f'run_dir="{tmp_path / "run"}"',
            f"inference.retries={RETRIES}",
            "inference.retry_backoff_s=0.001",
            'payload.mode="inline"',
        ],
    )
    state = RunState(Staleness(2, 1), Shipping(0))
    with (
        structlog.testing.capture_logs() as logs,
        trio.fail_after(20),
    ):
        async with garbage_server() as url, HTTP11Client() as client:
            pool = ServerPool.of([url], on_change=state.notify)
            # Training's runner: its rejections are the dispatch's.
            runner = RolloutRunner(config, state, client, pool, state.dispatch.rejections)
            for turn in range(TURNS):
                body = build_generate_request(
                    request_id=f"r{turn}",
                    token_ids=[1, 2, 3],
                    max_tokens=4,
                    seed=turn,
                    payload_dir=None,
                    routing_start=None,
                )
                with pytest.raises(InferenceFailure) as failure:
                    await runner._request_turn(
                        url, encode_generate_request(body), 3, 0, None, trio.Event()
                    )
                assert failure.value.kind == "malformed"

    # Every request counted once, under its kind, in the counter the metrics and summary
    # read: a malformed reply is not asked for again, whatever `retries` says.
    attempts = TURNS
    assert state.dispatch.failures["malformed"] == attempts
    assert state.dispatch.rejections.counts is state.dispatch.failures
    # The text the server kept sending is the most common error.
    top = state.dispatch.rejections.top_error()
    assert top is not None and top.kind == "malformed" and top.count == attempts
    # One warning line (the run took less than the 10 s interval), nothing per retry.
    lines = failure_lines(logs)
    assert len(lines) == 1, lines
    assert lines[0]["log_level"] == "warning"
    assert (lines[0]["kind"], lines[0]["server"]) == ("malformed", url)
    assert lines[0]["retrying"] is False
    assert "not JSON" in lines[0]["detail"]
    assert not [entry for entry in logs if entry["event"] == "retrying turn"]
    assert not [entry for entry in logs if entry["log_level"] == "info"]
