"""The local fleet's disaggregated prefill/decode over real loopback HTTP: a router in
front of a prefill and a decode server, each answering as the real ones do (the prefill
returns the prompt rows it computed, the decode its rows from the prompt's last token on),
the router merging inline as PrimeIntellect-ai/router does and forwarding both sides'
segments by handle. Every reply is read with the daemon's own parser, and payload files
with plain `os.pread`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from payload_gc import PayloadRootFiles

from orchestrator.config import Config, InferenceConfig, SimConfig
from orchestrator.core.samples import build_sample
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import check_turn_files
from orchestrator.payload import RoutingShape, read_sample_payload
from orchestrator.sim import FaultRates, SimInferenceConfig, SimModel, serve_inference
from orchestrator.sim.fleet import sim_inference_config
from orchestrator.sim.pd_router import PDRouterConfig, serve_pd_router
from orchestrator.wire import build_generate_request, parse_generate_response
from orchestrator.wire.arrays import ROUTING_DTYPES, decode_npy, decode_packed_routing

GENERATE = "/inference/v1/generate"
# 300 experts: a reply's ids may or may not fit uint8, so the sides narrow differently.
MODEL = SimModel(layers=4, num_experts=300, top_k=3, vocab_size=1000)
SHAPE = RoutingShape(4, 3, 300)
FIELDS = ("routed_experts", "sampling_mask")


async def _serve(nursery: trio.Nursery, config: SimInferenceConfig) -> httpx.AsyncClient:
    url = await nursery.start(serve_inference, config)
    client = httpx.AsyncClient(base_url=url, timeout=10)
    nursery.start_soon(_close_at_exit, client)
    return client


async def _close_at_exit(client: httpx.AsyncClient) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


def _prompt(count: int, seed: int = 0) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(3, 1000, count).tolist()
    return tokens


def _body(tokens: list[int], payload_dir: Path | None, *, start: int, seed: int = 5) -> Any:
    return build_generate_request(
        request_id=f"r-{seed}",
        token_ids=tokens,
        max_tokens=24,
        seed=seed,
        payload_dir=payload_dir,
        routing_start=start,
    )


async def _post(client: httpx.AsyncClient, body: Any) -> httpx.Response:
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 200, response.text
    return response


def _parse(
    response: httpx.Response, prompt_len: int, start: int, payload_dir: Path | None
) -> TurnOutput:
    return parse_generate_response(
        response.content,
        prompt_len=prompt_len,
        routing_start=start,
        payload_dir=payload_dir,
        fields=FIELDS,
        routing_shape=SHAPE,
    )


def _pread(segment: dict[str, Any]) -> np.ndarray:
    """A wire segment's rows, read as prime-rl's reader does."""
    dtype = np.dtype(segment["dtype"]).newbyteorder("<")
    row_bytes = dtype.itemsize * math.prod(segment["shape"])
    fd = os.open(segment["file"], os.O_RDONLY)
    try:
        data = os.pread(fd, segment["rows"] * row_bytes, segment["offset"])
    finally:
        os.close(fd)
    return np.frombuffer(data, dtype=dtype).reshape(segment["rows"], *segment["shape"])


def _inline_routing(choice: dict[str, Any]) -> tuple[np.ndarray, int | None]:
    value = choice["routed_experts"]
    if isinstance(value, str):
        return decode_npy(value, "routing", dtypes=ROUTING_DTYPES, ndim=3), None
    return decode_packed_routing(value, "routing", dtypes=ROUTING_DTYPES, ndim=3)


@pytest.mark.parametrize("form", ["prime-rl", "upstream"])
async def test_pd_inline_answers_what_an_aggregated_server_answers(
    nursery: trio.Nursery, form: Any
) -> None:
    whole = await _serve(nursery, SimInferenceConfig(model=MODEL, reply_form=form))
    pd = await _serve(nursery, SimInferenceConfig(model=MODEL, reply_form=form, disaggregated=True))
    for seed, start in [(1, 0), (2, 17), (3, 39)]:
        body = _body(_prompt(40, seed), None, start=start, seed=seed)
        expected = (await _post(whole, body)).json()["choices"][0]
        got = (await _post(pd, body)).json()["choices"][0]
        # The decode's completion is the aggregated server's: same request, same sample.
        for key in ("token_ids", "finish_reason", "completion_logprobs", "logprobs"):
            assert got.get(key) == expected.get(key), key
        assert got["sampling_mask"] == expected["sampling_mask"]
        # The router's merge: the prefill's prompt rows, then the decode's after them,
        # the same rows (and, prime-rl's form, the same narrowed dtype) as one server's.
        merged, merged_start = _inline_routing(got)
        whole_rows, whole_start = _inline_routing(expected)
        assert merged_start == whole_start
        assert merged.dtype == whole_rows.dtype
        assert np.array_equal(merged, whole_rows)


async def test_pd_by_handle_both_sides_write_their_rows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    whole = await _serve(nursery, SimInferenceConfig(model=MODEL))
    pd = await _serve(nursery, SimInferenceConfig(model=MODEL, disaggregated=True))
    payload_dir = tmp_path / "payloads" / "v3"
    tokens, start = _prompt(40), 11
    expected, _ = _inline_routing(
        (await _post(whole, _body(tokens, None, start=start))).json()["choices"][0]
    )
    response = await _post(pd, _body(tokens, payload_dir, start=start))
    choice = response.json()["choices"][0]
    segments = choice["payload"]
    assert choice["routed_experts"] is None and choice["sampling_mask"] is None
    files = list(dict.fromkeys(segment["file"] for segment in segments))
    assert len(files) == 2 and all(Path(f).parent == payload_dir for f in files)
    prefill = [s for s in segments if s["file"] == files[0]]
    decode = [s for s in segments if s["file"] == files[1]]
    routing_end = len(tokens) + len(choice["token_ids"]) - 1
    # The prefill computed the prompt from the requested start; it sampled one token,
    # whose mask row it wrote too (the router throws that token away).
    assert [(s["field"], s["pos"], s["rows"]) for s in prefill] == [
        ("routed_experts", start, len(tokens) - start),
        ("sampling_mask", len(tokens), 1),
    ]
    # The decode ran forward from the prompt's last token (its first forward pass).
    assert [(s["field"], s["pos"], s["rows"]) for s in decode] == [
        ("routed_experts", len(tokens) - 1, routing_end - len(tokens) + 1),
        ("sampling_mask", len(tokens), len(choice["token_ids"])),
    ]
    prompt_rows, decode_rows = _pread(prefill[0]), _pread(decode[0])
    # The row both computed is the same; together they are one server's rows.
    assert np.array_equal(prompt_rows[-1], decode_rows[0])
    stitched = np.concatenate([prompt_rows, decode_rows[1:]]).astype(expected.dtype)
    assert np.array_equal(stitched, expected)

    turn = _parse(response, len(tokens), start, payload_dir)
    assert turn.poisoned is None
    assert turn.files == set(files)
    with PayloadRootFiles(payload_dir.parent) as opened:
        assert check_turn_files(turn, files=opened, version=3).problem is None


@pytest.mark.parametrize("form", ["prime-rl", "upstream"])
async def test_inline_and_by_handle_give_bitwise_equal_training_tensors(
    nursery: trio.Nursery, tmp_path: Path, form: Any
) -> None:
    """A three-turn rollout with delta replay against P/D, inline and by handle (and
    against one aggregated server inline): the stitched samples' routing and masks are
    equal, dtype and bytes."""
    pd = await _serve(nursery, SimInferenceConfig(model=MODEL, reply_form=form, disaggregated=True))
    whole = await _serve(nursery, SimInferenceConfig(model=MODEL, reply_form=form))
    payload_dir = tmp_path / "payloads" / "v0"
    arrays: dict[str, dict[str, np.ndarray]] = {}
    runs: list[tuple[str, httpx.AsyncClient, Path | None]] = [
        ("pd-inline", pd, None),
        ("aggregated-inline", whole, None),
    ]
    if form == "prime-rl":  # upstream vLLM has no by-handle mode
        runs.append(("pd-by-handle", pd, payload_dir))
    for name, client, directory in runs:
        tokens = _prompt(30, seed=9)
        turns: list[tuple[int, TurnOutput]] = []
        start = 0
        for turn_index in range(3):
            body = _body(tokens, directory, start=start, seed=100 + turn_index)
            turn = _parse(await _post(client, body), len(tokens), start, directory)
            assert turn.poisoned is None, turn.poisoned
            turns.append((len(tokens), turn))
            reply = [7, 8, 9][: turn_index + 1]
            tokens = tokens + turn.completion_ids.tolist() + reply
            start = len(tokens) - len(reply) - 1
        tokens = tokens[: len(tokens) - 3]  # the last environment reply is not sent
        sample, dropped = build_sample(
            name, tokens, turns, payload_dir=directory, fields=FIELDS, final_token_route="repeat"
        )
        assert not dropped and sample.untrainable is None
        if directory is None:
            assert sample.inline is not None
            arrays[name] = dict(sample.inline)
        else:
            arrays[name] = read_sample_payload(directory, sample.payload, len(tokens), verify=True)
    reference = arrays["aggregated-inline"]
    for name, got in arrays.items():
        assert got.keys() == reference.keys(), name
        for field in got:
            assert got[field].dtype == reference[field].dtype, (name, field)
            assert got[field].tobytes() == reference[field].tobytes(), (name, field)


class _Side:
    """One side's server, which a test can stop: `stop()` returns once it is down."""

    def __init__(self, config: SimInferenceConfig) -> None:
        self.config = config
        self.scope = trio.CancelScope()
        self.down = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                await serve_inference(self.config, task_status=task_status)
        finally:
            self.down.set()

    async def stop(self) -> None:
        self.scope.cancel()
        await self.down.wait()


async def _sides(
    nursery: trio.Nursery,
    *,
    prefill: FaultRates | None = None,
    decode: FaultRates | None = None,
) -> tuple[httpx.AsyncClient, httpx.AsyncClient, httpx.AsyncClient, list[_Side]]:
    """A prefill and a decode server, and a router in front of them."""
    sides = [
        _Side(SimInferenceConfig(model=MODEL, role="prefill", faults=prefill or FaultRates())),
        _Side(SimInferenceConfig(model=MODEL, role="decode", faults=decode or FaultRates())),
    ]
    urls = [await nursery.start(side.serve) for side in sides]
    router_url = await nursery.start(serve_pd_router, PDRouterConfig(urls[0], urls[1]))
    clients = []
    for url in (*urls, router_url):
        client = httpx.AsyncClient(base_url=url, timeout=10)
        nursery.start_soon(_close_at_exit, client)
        clients.append(client)
    return clients[0], clients[1], clients[2], sides


async def test_each_side_refuses_requests_the_router_did_not_prepare(
    nursery: trio.Nursery,
) -> None:
    prefill, decode, router, _ = await _sides(nursery)
    body = _body(_prompt(20), None, start=0)
    for client, words in ((prefill, "do_remote_decode"), (decode, "do_remote_prefill")):
        response = await client.post(GENERATE, json=body)
        assert response.status_code == 400
        assert words in response.json()["error"]["message"]
    # KV blocks of another prompt.
    kv = (await router.post(GENERATE, json=body)).status_code
    assert kv == 200
    other = {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]}}
    response = await decode.post(GENERATE, json=other)
    assert response.status_code == 400 and "remote_block_ids" in response.text


async def test_the_router_answers_side_failures_as_the_real_one(nursery: trio.Nursery) -> None:
    body = _body(_prompt(20), None, start=0)
    _, _, router, _ = await _sides(nursery, prefill=FaultRates(http_500=1.0))
    response = await router.post(GENERATE, json=body)
    assert response.status_code == 500 and "prefill server error 500" in response.text

    _, _, router, _ = await _sides(nursery, decode=FaultRates(http_500=1.0))
    response = await router.post(GENERATE, json=body)
    assert response.status_code == 500 and "injected fault" in response.text

    _, _, router, _ = await _sides(nursery, decode=FaultRates(malformed=1.0))
    response = await router.post(GENERATE, json=body)
    assert response.status_code == 500 and "failed to parse decode response" in response.text


async def test_a_client_that_gives_up_is_not_waited_for(nursery: trio.Nursery) -> None:
    prefill, _, router, _ = await _sides(nursery, prefill=FaultRates(hang=1.0))
    with pytest.raises(httpx.ReadTimeout):
        await router.post(GENERATE, json=_body(_prompt(20), None, start=0), timeout=0.5)
    # The router dropped its request to the prefill, which stops waiting for it.
    for _ in range(500):
        health = (await prefill.get("/health")).json()
        if not health["in_flight"]:
            break
        await trio.sleep(0.02)
    assert health["in_flight"] == 0
    assert health["faults"]["hang"] == 1 and health["requests_served"] == 1


async def test_weights_and_health_reach_both_sides(nursery: trio.Nursery) -> None:
    prefill, decode, router, sides = await _sides(nursery)
    response = await router.post("/update_weights", json={"weight_dir": "/w/step_000004"})
    assert response.status_code == 200
    for side in (prefill, decode):
        assert (await side.get("/health")).json()["version"] == 4
    health = await router.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert {health.json()["prefill"]["role"], health.json()["decode"]["role"]} == {
        "prefill",
        "decode",
    }
    assert (await router.post("/update_weights", json={})).status_code == 400
    # A side that is down makes the deployment unavailable.
    await sides[1].stop()
    health = await router.get("/health")
    assert health.status_code == 503 and "error" in health.json()["decode"]
    response = await router.post("/update_weights", json={"weight_dir": "/w/step_000005"})
    assert response.status_code == 503


def test_a_side_cannot_also_be_a_deployment() -> None:
    with pytest.raises(ValueError, match="one side"):
        SimInferenceConfig(role="decode", disaggregated=True)
    with pytest.raises(ValueError, match="role"):
        SimInferenceConfig(role="router")  # type: ignore[arg-type]


def test_the_run_config_makes_each_local_server_a_deployment(tmp_path: Path) -> None:
    config = Config(
        run_dir=tmp_path,
        inference=InferenceConfig(disaggregated=True),
        sim=SimConfig(inference_servers=2),
    )
    server = sim_inference_config(config, 1)
    assert server.disaggregated and server.role == "aggregated"
    assert not sim_inference_config(
        Config(run_dir=tmp_path, sim=SimConfig(inference_servers=1)), 0
    ).disaggregated
