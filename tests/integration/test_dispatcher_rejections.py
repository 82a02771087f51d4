"""Every rejection of the dispatcher goes through `Dispatch.rejections`: a server that
answers garbage to every request is counted per request, not asked again (it would answer
the same), and logged at warning level with its reason at once, then once per interval;
a choice of a group's request that cannot be read fails its rollout alone. A real server
on 127.0.0.1 answers."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h11
import numpy as np
import pytest
import structlog.testing
import trio

from orchestrator.config import load_config
from orchestrator.core.environments import Episode, Prompt, Sampling
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.inference.client import encode_generate_request
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.rollout_runner import RolloutRunner
from orchestrator.daemon.run_state import RunState, Shipping
from orchestrator.wire import InferenceFailure, build_generate_request

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
GARBAGE = b"<html>502 from a proxy, not JSON</html>"
TURNS = 30
RETRIES = 3


async def answer(answer_to: Callable[[bytes], bytes], stream: trio.SocketStream) -> None:
    """Answer every request on the connection with 200 and `answer_to(its body)`."""
    connection = h11.Connection(h11.SERVER)
    body = b""
    with contextlib.suppress(trio.BrokenResourceError, h11.RemoteProtocolError):
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                connection.receive_data(data)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                content = answer_to(body)
                body = b""
                headers = [
                    ("content-type", "application/json"),
                    ("content-length", str(len(content))),
                ]
                reply = connection.send(h11.Response(status_code=200, headers=headers))
                reply += connection.send(h11.Data(data=content))
                reply += connection.send(h11.EndOfMessage())
                await stream.send_all(reply)
                connection.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return


@contextlib.asynccontextmanager
async def answering_server(answer_to: Callable[[bytes], bytes]) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        handler = functools.partial(answer, answer_to)
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def garbage_server() -> contextlib.AbstractAsyncContextManager[str]:
    """A server that answers every request with 200 and a body that is not JSON."""
    return answering_server(lambda body: GARBAGE)


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
                    await runner._request_turns(
                        url, encode_generate_request(body), 1, 3, 0, None, trio.Event()
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


class OneTurn:
    """A single-turn episode: no reply after the completion."""

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> None:
        return None

    async def score(self, completions: object) -> float:
        return 0.0


def three_choices(body: bytes) -> bytes:
    """A group's reply: its second choice's token ids are not ids."""
    params = json.loads(body)["sampling_params"]
    assert params["n"] == 3, params
    good = {"index": 0, "token_ids": [5, 6], "finish_reason": "stop"}
    good["logprobs"] = {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}
    bad = {**good, "index": 1, "token_ids": [5, "six"]}
    return json.dumps({"choices": [good, bad, {**good, "index": 2}]}).encode()


async def test_a_groups_first_turn_is_one_request_and_a_bad_choice_fails_alone(
    tmp_path: Path,
) -> None:
    config = load_config(
        DEMO,
        [
            f'run_dir="{tmp_path / "run"}"',
            "batch.group_size=3",
            "inference.group_request=true",
            "payload.fields=[]",
        ],
    )
    assert config.group_choices == 3
    state = RunState(Staleness(2, 1), Shipping(0))
    requests: list[bytes] = []

    def answer_to(body: bytes) -> bytes:
        requests.append(body)
        return three_choices(body)

    prompt = Prompt("p0", np.array([1, 2, 3]), sampling=Sampling(max_tokens=4))
    runs: list[RolloutRun | None] = [None] * 3
    episodes: list[Episode] = [OneTurn(), OneTurn(), OneTurn()]
    with trio.fail_after(20):
        async with answering_server(answer_to) as url, HTTP11Client() as client:
            pool = ServerPool.of([url], on_change=state.notify)
            runner = RolloutRunner(config, state, client, pool, state.dispatch.rejections)
            await runner.run_group(runs, "g1", prompt, list(episodes), url, trio.Event())

    assert len(requests) == 1
    assert json.loads(requests[0])["request_id"] == "g1-t0"
    ok = [run for run in runs if run is not None and run.failed is None]
    assert [run.rollout_id for run in ok] == ["g1-r0", "g1-r2"]
    assert all(run.tokens.tolist() == [1, 2, 3, 5, 6] for run in ok)
    failed = runs[1]
    assert failed is not None and failed.failure_kind == "malformed"
    assert failed.failed is not None and "choices[1]" in failed.failed
    assert state.dispatch.failures["malformed"] == 1
