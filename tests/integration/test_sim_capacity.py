"""The local server's capacity (`max_num_seqs`, as vLLM's): sequences beyond it wait their
turn, so turnaround grows with what is sent, as on a real server; a request's `n` choices
are `n` sequences, and a request for more than the bound is refused as vLLM refuses it."""

from __future__ import annotations

import httpx
import numpy as np
import trio

from orchestrator.daemon.inference.client import encode_generate_request
from orchestrator.sim import SimInferenceConfig, SimModel, serve_inference
from orchestrator.wire import build_generate_request

MODEL = SimModel(layers=2, num_experts=16, top_k=2, vocab_size=100)
REQUESTS = 5


async def _health(client: httpx.AsyncClient) -> dict[str, int]:
    reply = await client.get("/health")
    reply.raise_for_status()
    body = reply.json()
    return {"in_flight": body["in_flight"], "running": body["running"]}


def _request(index: int, choices: int = 1) -> bytes:
    body = build_generate_request(
        request_id=f"r{index}",
        token_ids=np.arange(8, dtype=np.int32),
        max_tokens=4,
        seed=index,
        payload_dir=None,
        routing_start=None,
        model="",
        choices=choices,
    )
    return encode_generate_request(body)


async def _counts_while_busy(max_num_seqs: int, choices: int = 1) -> list[dict[str, int]]:
    """Send REQUESTS slow requests of `choices` choices at once; the health counts seen
    until all are in."""
    config = SimInferenceConfig(
        model=MODEL, max_num_seqs=max_num_seqs, time_per_token_s=0.05, request_overhead_s=1.0
    )
    seen: list[dict[str, int]] = []
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_inference, config)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def generate(index: int) -> None:
                reply = await client.post(
                    "/inference/v1/generate",
                    content=_request(index, choices),
                    headers={"content-type": "application/json"},
                )
                assert reply.status_code == 200, reply.text
                assert len(reply.json()["choices"]) == choices

            with trio.fail_after(60):
                async with trio.open_nursery() as requests:
                    for index in range(REQUESTS):
                        requests.start_soon(generate, index)
                    # Until every request has reached the server, and a while after.
                    while not seen or seen[-1]["in_flight"] < REQUESTS:
                        seen.append(await _health(client))
                        await trio.sleep(0.01)
                    seen.append(await _health(client))
        nursery.cancel_scope.cancel()
    return seen


async def test_requests_beyond_max_num_seqs_wait_their_turn() -> None:
    seen = await _counts_while_busy(2)
    assert seen[-1]["in_flight"] == REQUESTS
    # Never more than two generate at once; with all five in, three wait.
    assert max(counts["running"] for counts in seen) == 2
    assert seen[-1]["running"] == 2


async def test_without_a_bound_every_request_runs_at_once() -> None:
    seen = await _counts_while_busy(0)
    assert seen[-1] == {"in_flight": REQUESTS, "running": REQUESTS}


async def test_a_requests_choices_each_take_a_sequence() -> None:
    seen = await _counts_while_busy(4, choices=2)
    assert seen[-1]["in_flight"] == REQUESTS
    # Two requests of two choices fill the four sequences; the other three wait.
    assert max(counts["running"] for counts in seen) == 4
    assert seen[-1]["running"] == 4


async def test_more_choices_than_max_num_seqs_are_refused_as_vllm_refuses_them() -> None:
    config = SimInferenceConfig(model=MODEL, max_num_seqs=4)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_inference, config)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            reply = await client.post("/inference/v1/generate", content=_request(0, choices=5))
        nursery.cancel_scope.cancel()
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "sampling_params.n must be at most the server's max_num_seqs (4), got 5."
    )
