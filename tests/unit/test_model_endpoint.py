"""The daemon's model endpoint for environments that drive their own turns: a call goes to
the rollout that holds its key and is answered as vLLM's generate endpoint answers; what
the endpoint or the rollout will not run is answered with vLLM's error body and why."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest
import trio

from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.model_endpoint import (
    CallRefused,
    GenerateCall,
    ModelDesk,
    parse_generate_call,
)
from orchestrator.httpx_body import request_bytes

GENERATE = "/inference/v1/generate"


async def echo_two(call: GenerateCall) -> TurnOutput:
    """A turn that samples the last two prompt tokens back."""
    return TurnOutput(call.token_ids[-2:], (-0.5, -0.25), "length")


@asynccontextmanager
async def served(
    run_turn: Callable[[GenerateCall], Awaitable[TurnOutput]],
) -> AsyncIterator[tuple[ModelDesk, str, httpx.AsyncClient]]:
    desk = ModelDesk("sim-moe", 4096)
    async with trio.open_nursery() as nursery:
        desk.attach(nursery)
        base = await desk.url()
        async with desk.rollout(run_turn) as (model_url, calls):
            nursery.start_soon(calls.serve)
            async with httpx.AsyncClient(base_url=model_url, timeout=10) as client:
                yield desk, base, client
        nursery.cancel_scope.cancel()


async def post(client: httpx.AsyncClient, body: object, url: str = GENERATE) -> httpx.Response:
    return await request_bytes(client, "POST", url, json.dumps(body).encode(), headers={})


async def test_a_call_is_run_by_its_rollout_and_answered_as_vllm_answers() -> None:
    async with served(echo_two) as (_, _, client):
        answer = await post(client, {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}})
        models = (await client.get("/v1/models")).json()
    assert answer.status_code == 200
    choice = answer.json()["choices"][0]
    assert choice["token_ids"] == [6, 7]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["content"] == [
        {"token": "token_id:6", "logprob": -0.5},
        {"token": "token_id:7", "logprob": -0.25},
    ]
    assert answer.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert models["data"][0]["id"] == "sim-moe" and models["data"][0]["max_model_len"] == 4096


async def test_what_is_not_run_is_answered_with_the_reason() -> None:
    async def refuse(call: GenerateCall) -> TurnOutput:
        raise CallRefused(400, "the rollout has had its 1 turns (max_turns)")

    async with served(refuse) as (_, base, client):
        refused = await post(client, {"token_ids": [1]})
        bad = await post(client, {"token_ids": []})
        async with httpx.AsyncClient(base_url=base, timeout=10) as other:
            unknown = await post(other, {"token_ids": [1]}, f"/rollouts/not-a-key{GENERATE}")
    assert refused.status_code == 400
    assert "max_turns" in refused.json()["error"]["message"]
    assert bad.status_code == 400 and "token_ids" in bad.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


async def test_a_call_cut_off_by_the_end_of_its_rollout_is_answered_410() -> None:
    started = trio.Event()

    async def hang(call: GenerateCall) -> TurnOutput:
        started.set()
        await trio.sleep_forever()
        raise AssertionError

    desk = ModelDesk("m", 64)
    answers: list[httpx.Response] = []
    answered = trio.Event()
    async with trio.open_nursery() as nursery:
        desk.attach(nursery)
        async with httpx.AsyncClient(timeout=10) as client:
            async with desk.rollout(hang) as (model_url, calls):
                url = f"{model_url}{GENERATE}"

                async def call() -> None:
                    answers.append(await post(client, {"token_ids": [1]}, url))
                    answered.set()

                async with trio.open_nursery() as rollout:
                    rollout.start_soon(calls.serve)
                    nursery.start_soon(call)
                    await started.wait()
                    rollout.cancel_scope.cancel()  # the rollout ends mid-call
            await answered.wait()
        nursery.cancel_scope.cancel()
    assert answers[0].status_code == 410


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"token_ids": [1, -2]}', "token_ids"),
        (b'{"token_ids": [1.5]}', "token_ids"),
        (b'{"token_ids": [1], "sampling_params": {"max_tokens": 0}}', "max_tokens"),
        (b'{"token_ids": [1], "sampling_params": {"stop_token_ids": ["a"]}}', "stop_token_ids"),
    ],
)
def test_a_malformed_call_is_refused_naming_what_is_wrong(body: bytes, problem: str) -> None:
    with pytest.raises(CallRefused, match=problem) as refused:
        parse_generate_call(body)
    assert refused.value.status == 400


def test_a_call_keeps_the_token_ids_and_what_the_environment_asked_for() -> None:
    call = parse_generate_call(
        b'{"token_ids": [3, 4], "sampling_params": {"max_tokens": 9, "stop_token_ids": [2],'
        b' "temperature": 0.1, "routed_experts_prompt_start": 1}}'
    )
    assert np.array_equal(call.token_ids, [3, 4])
    assert (call.max_tokens, call.stop_token_ids) == (9, (2,))
