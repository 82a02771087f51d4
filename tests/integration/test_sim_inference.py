"""The simulated inference server over real loopback HTTP, with real payload files.

Every reply is read with the daemon's own parser (`orchestrator.wire`), so the server and
the client are held to the same protocol; payload files are read back with plain
`os.pread`, following prime-rl's reader rule.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from orchestrator.config import Config, InferenceConfig, SimConfig
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import RoutingShape, payload_digest
from orchestrator.sim import (
    FaultRates,
    SamplingParams,
    SimInferenceConfig,
    SimModel,
    prefix_hashes,
    route,
    sample_completion,
    serve_inference,
)
from orchestrator.sim._response import TRAVERSAL_FILE_NAME
from orchestrator.sim.fleet import sim_inference_config
from orchestrator.wire import build_generate_request, parse_generate_response
from orchestrator.wire.segments import SEGMENT_KEYS

GENERATE = "/inference/v1/generate"
# A small model keeps the tests fast; the benchmark runs the default 48-layer shape.
MODEL = SimModel(layers=6, num_experts=64, top_k=4, vocab_size=1000)
SHAPE = RoutingShape(6, 4, 64)
FIELDS = ("routed_experts", "sampling_mask")


async def _start(nursery: trio.Nursery, **changes: Any) -> httpx.AsyncClient:
    config = SimInferenceConfig(model=changes.pop("model", MODEL), **changes)
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


def _request(
    tokens: list[int],
    payload_dir: Path | None,
    *,
    seed: int = 7,
    n: int = 1,
    start: int = 0,
    max_tokens: int = 48,
    logprobs: int | None = 1,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 20,
        "seed": seed,
        "n": n,
        "logprobs": logprobs,
        "routed_experts_prompt_start": start,
    }
    if payload_dir is not None:
        params["extra_args"] = {"payload_dir": str(payload_dir)}
    return {"request_id": f"req-{seed}", "token_ids": tokens, "sampling_params": params}


def _prompt(count: int, seed: int = 0) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(3, 1000, count).tolist()
    return tokens


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 200, response.text
    return response


async def _generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = (await _post(client, body)).json()
    return result


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


def _pread(segment: dict[str, Any], lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """Rows `lo .. hi` (positions) of a wire segment, read as prime-rl's reader does:
    `row_bytes = itemsize * prod(row shape)`, position `p` at `offset + (p - pos) *
    row_bytes`."""
    pos, rows = segment["pos"], segment["rows"]
    lo = pos if lo is None else lo
    hi = pos + rows if hi is None else hi
    assert pos <= lo <= hi <= pos + rows
    dtype = np.dtype(segment["dtype"]).newbyteorder("<")
    row_bytes = dtype.itemsize * math.prod(segment["shape"])
    fd = os.open(segment["file"], os.O_RDONLY)
    try:
        data = os.pread(fd, (hi - lo) * row_bytes, segment["offset"] + (lo - pos) * row_bytes)
    finally:
        os.close(fd)
    assert len(data) == (hi - lo) * row_bytes
    return np.frombuffer(data, dtype=dtype).reshape(hi - lo, *segment["shape"])


def _size(path: str | Path) -> int:
    return os.stat(path).st_size


def _read(path: str, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _routing_of(tokens: list[int]) -> np.ndarray:
    """The model's routing rows for every position of `tokens` but the last."""
    return route(MODEL, prefix_hashes(tokens[:-1]))


def _open_paths() -> set[str]:
    """Files this process has open (the server runs in-process)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return paths


@pytest.mark.parametrize("start", [0, 123])
async def test_every_reply_form_gives_the_same_turn(
    nursery: trio.Nursery, tmp_path: Path, start: int
) -> None:
    primerl = await _start(nursery)
    upstream = await _start(nursery, reply_form="upstream")
    payload_dir = tmp_path / "payloads" / "v3"
    prompt = _prompt(300)
    # The daemon's own request builder: only keys vLLM defines, accepted by both.
    body = build_generate_request(
        request_id="r", token_ids=prompt, max_tokens=48, seed=7, payload_dir=None,
        routing_start=start, model="sim-moe",
    )  # fmt: skip
    handle_body = build_generate_request(
        request_id="r", token_ids=prompt, max_tokens=48, seed=7, payload_dir=payload_dir,
        routing_start=start, model="sim-moe",
    )  # fmt: skip
    inline_reply = await _post(primerl, body)
    handle_reply = await _post(primerl, handle_body)
    upstream_reply = await _post(upstream, body)

    inline = _parse(inline_reply, 300, start, None)
    handle = _parse(handle_reply, 300, start, payload_dir)
    upstream_turn = _parse(upstream_reply, 300, start, None)
    for turn in (inline, handle, upstream_turn):
        assert turn.poisoned is None
        np.testing.assert_array_equal(turn.completion_ids, inline.completion_ids)
        np.testing.assert_array_equal(turn.logprobs, inline.logprobs)
        assert turn.finish_reason == inline.finish_reason
    completion = list(inline.completion_ids)
    rows = 300 + len(completion) - 1 - start

    # The server's completion is the model's, recomputed here from the request alone.
    params = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    expected = sample_completion(MODEL, int(prefix_hashes(prompt)[-1]), params, 0)
    assert completion == expected.token_ids.tolist()
    assert inline.logprobs.tolist() == expected.logprobs.tolist()
    routing = _routing_of(prompt + completion)[start:]
    assert routing.shape == (rows, 6, 4)

    # Inline, both forms: routing from the requested start, masks over the completion.
    for turn in (inline, upstream_turn):
        routed, pos = turn.inline["routed_experts"]
        assert pos == start
        np.testing.assert_array_equal(routed, routing)
        assert routed.dtype == np.uint8
        mask, mask_pos = turn.inline["sampling_mask"]
        assert mask_pos == 300
        np.testing.assert_array_equal(mask, expected.sampling_mask)

    # By handle: routing then mask in one new file, read back bitwise equal.
    [choice] = handle_reply.json()["choices"]
    assert choice["routed_experts"] is None
    assert choice["sampling_mask"] is None
    assert choice["logprobs"] is None
    routed_segment, mask_segment = choice["payload"]
    assert list(routed_segment) == list(SEGMENT_KEYS)
    assert routed_segment["field"] == "routed_experts"
    assert mask_segment["field"] == "sampling_mask"
    assert routed_segment["file"] == mask_segment["file"]
    file = Path(routed_segment["file"])
    assert file.parent == payload_dir
    assert [p.name for p in payload_dir.iterdir()] == [file.name]
    assert (routed_segment["offset"], routed_segment["pos"]) == (0, start)
    assert (routed_segment["rows"], routed_segment["shape"]) == (rows, [6, 4])
    assert routed_segment["dtype"] == "uint8"
    assert (mask_segment["pos"], mask_segment["rows"]) == (300, len(completion))
    assert mask_segment["offset"] == rows * 6 * 4
    assert mask_segment["dtype"] == "int32"
    assert mask_segment["shape"] == [expected.sampling_mask.shape[1]]
    assert _size(file) == mask_segment["offset"] + expected.sampling_mask.nbytes
    np.testing.assert_array_equal(_pread(routed_segment), routing)
    np.testing.assert_array_equal(_pread(mask_segment), expected.sampling_mask)
    # Any window of rows, as a trainer reads its clip of a segment.
    np.testing.assert_array_equal(_pread(routed_segment, start + 5, start + 9), routing[5:9])
    assert set(handle.segments) == set(FIELDS)
    assert handle.segments["routed_experts"].pos == start
    assert handle.files == {str(file)}

    for reply in (inline_reply, handle_reply, upstream_reply):
        doc = reply.json()
        assert doc["request_id"] == "generate-tokens-r"  # vLLM prefixes it
        assert doc["prompt_logprobs"] is None
        assert doc["kv_transfer_params"] is None
        assert doc["usage"] == {
            "prompt_tokens": 300,
            "total_tokens": 300 + len(completion),
            "completion_tokens": len(completion),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }


@pytest.mark.parametrize("form", ["inline", "by_handle", "upstream"])
async def test_delta_replay_returns_only_the_later_rows(
    nursery: trio.Nursery, tmp_path: Path, form: str
) -> None:
    client = await _start(nursery, reply_form="upstream" if form == "upstream" else "prime-rl")
    payload_dir = tmp_path / "v0" if form == "by_handle" else None

    async def rows(tokens: list[int], seed: int, start: int) -> tuple[list[int], np.ndarray]:
        reply = await _post(client, _request(tokens, payload_dir, seed=seed, start=start))
        turn = _parse(reply, len(tokens), start, payload_dir)
        assert turn.poisoned is None
        if payload_dir is None:
            routed, pos = turn.inline["routed_experts"]
        else:
            [segment, _] = reply.json()["choices"][0]["payload"]
            routed, pos = _pread(segment), segment["pos"]
        assert pos == start
        return turn.completion_ids.tolist(), routed

    turn1_prompt = _prompt(100)
    completion1, turn1_rows = await rows(turn1_prompt, 1, 0)
    turn2_prompt = turn1_prompt + completion1 + _prompt(20, seed=1)
    # The client holds every row turn 1 ran forward: it asks for the rest only.
    start = len(turn1_prompt) + len(completion1) - 1
    assert turn1_rows.shape[0] == start
    completion2, turn2_rows = await rows(turn2_prompt, 2, start)
    assert turn2_rows.shape[0] == len(turn2_prompt) + len(completion2) - 1 - start
    # The same request from position 0: its earlier rows are turn 1's (routing is a
    # function of the prefix), its later rows the delta's.
    again, full = await rows(turn2_prompt, 2, 0)
    assert again == completion2
    np.testing.assert_array_equal(full[:start], turn1_rows)
    np.testing.assert_array_equal(full[start:], turn2_rows)
    np.testing.assert_array_equal(full, _routing_of(turn2_prompt + completion2))


async def test_the_last_prompt_position_alone(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery)
    prompt = _prompt(10)
    body = _request(prompt, tmp_path / "v0", start=9, max_tokens=1)
    reply = await _post(client, body)
    [routed_segment, _] = reply.json()["choices"][0]["payload"]
    # One completion token, never run forward: the prompt's last position is the one row.
    assert (routed_segment["pos"], routed_segment["rows"]) == (9, 1)
    assert _parse(reply, 10, 9, tmp_path / "v0").poisoned is None


async def test_routing_is_narrowed_per_reply_by_prime_rl_only(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # 257 experts: the model's dtype is uint16, but a short reply's ids may all fit a byte.
    model = SimModel(layers=2, num_experts=257, top_k=2, vocab_size=100)
    primerl = await _start(nursery, model=model)
    upstream = await _start(nursery, model=model, reply_form="upstream")
    prompt = [5, 6, 7]
    expected = route(model, prefix_hashes(prompt))
    assert expected.dtype == np.uint16
    assert int(expected.max()) <= 255, "these inputs route below 256"

    def routing(reply: httpx.Response, payload_dir: Path | None = None) -> np.ndarray:
        # No model shape: uint8 rows would contradict its 257 experts (see the report).
        turn = parse_generate_response(
            reply.content, prompt_len=3, routing_start=0, payload_dir=payload_dir, fields=FIELDS
        )
        assert turn.poisoned is None
        if payload_dir is not None:
            return _pread(reply.json()["choices"][0]["payload"][0])
        routed: np.ndarray = turn.inline["routed_experts"][0]
        return routed

    body = _request(prompt, None, max_tokens=1)
    narrowed = routing(await _post(primerl, body))
    wide = routing(await _post(upstream, body))
    by_handle = routing(
        await _post(primerl, _request(prompt, tmp_path / "v0", max_tokens=1)), tmp_path / "v0"
    )
    dtypes = [rows.dtype.name for rows in (narrowed, wide, by_handle)]
    assert dtypes == ["uint8", "uint16", "uint8"]
    for rows in (narrowed, wide, by_handle):
        np.testing.assert_array_equal(rows, expected)


async def test_upstream_ignores_payload_dir(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery, reply_form="upstream")
    payload_dir = tmp_path / "v0"
    reply = await _post(client, _request(_prompt(40), payload_dir))
    [choice] = reply.json()["choices"]
    assert list(choice) == [
        "index",
        "token_ids",
        "finish_reason",
        "logprobs",
        "routed_experts",
        "sampling_mask",
    ]
    assert isinstance(choice["routed_experts"], str)
    assert not payload_dir.exists()
    assert (await client.get("/health")).json()["payload_files_written"] == 0
    # The daemon sees an inline answer to a by-handle request and says why.
    turn = _parse(reply, 40, 0, payload_dir)
    assert turn.poisoned is not None
    assert "ignores extra_args.payload_dir" in turn.poisoned


@pytest.mark.parametrize("form", ["prime-rl", "upstream"])
async def test_capture_off_gives_null_fields(
    nursery: trio.Nursery, tmp_path: Path, form: str
) -> None:
    client = await _start(
        nursery, reply_form=form, capture_routed_experts=False, capture_sampling_mask=False
    )
    payload_dir = tmp_path / "v0"
    inline = (await _generate(client, _request(_prompt(30), None)))["choices"][0]
    assert inline["routed_experts"] is None
    assert inline["sampling_mask"] is None
    handle = (await _generate(client, _request(_prompt(30), payload_dir)))["choices"][0]
    assert handle["routed_experts"] is None
    assert handle["sampling_mask"] is None
    if form == "prime-rl":
        assert inline["payload"] is None
        assert handle["payload"] == []
    assert not payload_dir.exists()
    reply = await _post(client, _request(_prompt(30), None))
    turn = _parse(reply, 30, 0, None)
    assert turn.poisoned is not None
    assert "routing capture" in turn.poisoned


async def test_mask_only_by_handle(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery, capture_routed_experts=False)
    result = await _generate(client, _request(_prompt(30), tmp_path / "v0"))
    [segment] = result["choices"][0]["payload"]
    assert (segment["field"], segment["offset"], segment["pos"]) == ("sampling_mask", 0, 30)


async def test_no_logprobs_unless_asked(nursery: trio.Nursery) -> None:
    primerl = await _start(nursery)
    upstream = await _start(nursery, reply_form="upstream")
    body = _request(_prompt(20), None, logprobs=None)
    choice = (await _generate(primerl, body))["choices"][0]
    assert choice["completion_logprobs"] is None
    assert choice["logprobs"] is None
    assert (await _generate(upstream, body))["choices"][0]["logprobs"] is None


async def test_payload_digests_are_optional(nursery: trio.Nursery, tmp_path: Path) -> None:
    plain = await _start(nursery)
    digested = await _start(nursery, payload_digests=True)
    body = _request(_prompt(20), tmp_path / "v0")
    for segment in (await _generate(plain, body))["choices"][0]["payload"]:
        assert "digest" not in segment
    reply = await _post(digested, body)
    for segment in reply.json()["choices"][0]["payload"]:
        nbytes = segment["rows"] * np.dtype(segment["dtype"]).itemsize * math.prod(segment["shape"])
        data = _read(segment["file"], segment["offset"], nbytes)
        assert segment["digest"] == payload_digest(data)
    turn = _parse(reply, 20, 0, tmp_path / "v0")
    assert turn.poisoned is None
    assert turn.segments["routed_experts"].digest is not None


async def test_payload_file_is_closed_and_present_when_the_response_arrives(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, fsync=True)
    payload_dir = tmp_path / "v1"
    result = await _generate(client, _request(_prompt(64), payload_dir, n=3))
    files = {choice["payload"][0]["file"] for choice in result["choices"]}
    assert len(files) == 3, "one file per choice"
    assert {str(path) for path in payload_dir.iterdir()} == files
    open_now = _open_paths()
    for name in files:
        assert name not in open_now
    assert [choice["index"] for choice in result["choices"]] == [0, 1, 2]
    completions = [choice["token_ids"] for choice in result["choices"]]
    assert len({tuple(c) for c in completions}) == 3, "each choice samples its own tokens"
    health = (await client.get("/health")).json()
    assert health["payload_files_written"] == 3
    assert health["payload_bytes_written"] == sum(_size(name) for name in files)


async def test_stop_token_ids_end_the_completion(nursery: trio.Nursery) -> None:
    client = await _start(nursery)
    prompt = _prompt(20)
    free = (await _generate(client, _request(prompt, None, max_tokens=40)))["choices"][0]
    stop = free["token_ids"][3]
    body = _request(prompt, None, max_tokens=40)
    body["sampling_params"]["stop_token_ids"] = [stop]
    stopped = (await _generate(client, body))["choices"][0]
    cut = free["token_ids"].index(stop) + 1
    assert stopped["token_ids"] == free["token_ids"][:cut]
    assert stopped["finish_reason"] == "stop"


async def test_max_tokens_defaults_to_what_the_context_leaves(nursery: trio.Nursery) -> None:
    client = await _start(nursery, max_model_len=40)
    body = _request(_prompt(30), None)
    del body["sampling_params"]["max_tokens"]
    lengths = set()
    for seed in range(8):
        body["sampling_params"]["seed"] = seed
        lengths.add(len((await _generate(client, body))["choices"][0]["token_ids"]))
    assert max(lengths) <= 10
    assert 10 in lengths
    body["sampling_params"]["max_tokens"] = 11
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 400
    assert "max_model_len" in response.json()["error"]["message"]


async def test_model_name_is_checked(nursery: trio.Nursery) -> None:
    client = await _start(nursery, served_model_name="Qwen/Qwen3-30B-A3B")
    body = _request(_prompt(5), None)
    body["model"] = "Qwen/Qwen3-30B-A3B"
    await _post(client, body)
    body["model"] = "sim-moe"
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `sim-moe` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    del body["model"]
    await _post(client, body)


async def test_update_weights_and_health(nursery: trio.Nursery) -> None:
    client = await _start(nursery)
    health = (await client.get("/health")).json()
    assert health["version"] == 0
    assert health["model"] == "sim-moe"
    assert health["requests_served"] == 0
    assert health["in_flight"] == 0

    await _generate(client, _request(_prompt(80), None))
    response = await client.post("/update_weights", json={"weight_dir": "/run/weights/step_000004"})
    assert response.status_code == 200
    assert response.json() == {"weight_dir": "/run/weights/step_000004", "version": 4}
    health = (await client.get("/health")).json()
    assert health["version"] == 4
    assert health["weight_dir"] == "/run/weights/step_000004"
    assert health["requests_served"] == 1
    assert health["faults"] == dict.fromkeys(
        ("http_500", "hang", "malformed", "bad_segment", "payload_error"), 0
    )

    bad = await client.post("/update_weights", json={"weight_dir": 5})
    assert bad.status_code == 400
    assert "weight_dir" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "not JSON"),
        (b'{"request_id": "x"}', "token_ids"),
        (b'{"token_ids": [1], "sampling_params": {}, "return_routed_experts": true}',
         "'return_routed_experts'"),
        (b'{"token_ids": [1], "sampling_params": {}, "stream": true}', "streaming"),
    ],
)  # fmt: skip
async def test_bad_body_gets_400_with_vllms_error_body(
    nursery: trio.Nursery, body: bytes, message: str
) -> None:
    client = await _start(nursery)
    response = await client.post(GENERATE, content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", None, 400)


async def test_unknown_route_and_method(nursery: trio.Nursery) -> None:
    client = await _start(nursery)
    missing = await client.get("/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"
    wrong = await client.get(GENERATE)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == 405


async def test_http_500_fault(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery, faults=FaultRates(http_500=1.0))
    response = await client.post(GENERATE, json=_request(_prompt(10), tmp_path / "v0"))
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert not (tmp_path / "v0").exists()
    assert (await client.get("/health")).json()["faults"]["http_500"] == 1


async def test_hang_fault_holds_until_the_client_gives_up(nursery: trio.Nursery) -> None:
    client = await _start(nursery, faults=FaultRates(hang=1.0))
    with pytest.raises(httpx.ReadTimeout):
        await client.post(GENERATE, json=_request(_prompt(10), None), timeout=0.3)
    health = (await client.get("/health")).json()
    assert health["faults"]["hang"] == 1
    # The server notices the client left and stops waiting.
    with trio.fail_after(5):
        while health["in_flight"]:
            await trio.sleep(0.01)
            health = (await client.get("/health")).json()
    assert health["requests_served"] == 1


async def test_malformed_fault_truncates_the_json(nursery: trio.Nursery) -> None:
    client = await _start(nursery, faults=FaultRates(malformed=1.0))
    response = await client.post(GENERATE, json=_request(_prompt(10), None))
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        response.json()
    assert response.text.startswith('{"request_id":')
    assert (await client.get("/health")).json()["faults"]["malformed"] == 1


async def test_bad_segment_fault_gives_a_file_outside_or_an_offset_past_the_end(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, faults=FaultRates(bad_segment=1.0), fault_seed=3)
    payload_dir = tmp_path / "v0"
    seen = set()
    for seed in range(12):
        reply = await _post(client, _request(_prompt(20), payload_dir, seed=seed))
        segment = reply.json()["choices"][0]["payload"][0]
        if segment["file"] == f"{payload_dir}/{TRAVERSAL_FILE_NAME}":
            seen.add("traversal")
            # Refused by the daemon's parser already: never followed.
            poisoned = _parse(reply, 20, 0, payload_dir).poisoned
            assert poisoned is not None
            assert TRAVERSAL_FILE_NAME in poisoned
        else:
            size = _size(segment["file"])
            nbytes = segment["rows"] * math.prod(segment["shape"])  # uint8 routing ids
            assert segment["offset"] + nbytes > size
            seen.add("past_end")
    assert seen == {"traversal", "past_end"}
    assert (await client.get("/health")).json()["faults"]["bad_segment"] == 12


async def test_payload_error_fault_carries_no_payload(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, faults=FaultRates(payload_error=1.0))
    reply = await _post(client, _request(_prompt(10), tmp_path / "v0"))
    [choice] = reply.json()["choices"]
    assert choice["payload"] is None
    assert "fault" in choice["payload_error"]
    assert choice["token_ids"]
    assert (await client.get("/health")).json()["faults"]["payload_error"] == 1
    turn = _parse(reply, 10, 0, tmp_path / "v0")
    assert turn.poisoned is not None
    assert turn.poisoned.startswith("payload_error: ")


async def test_unwritable_payload_dir_reports_payload_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = await _generate(client, _request(_prompt(10), blocker / "v0"))
    [choice] = result["choices"]
    assert choice["payload"] is None
    assert choice["payload_error"]


async def test_latency_model_on_virtual_time(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    config = SimInferenceConfig(model=MODEL, time_per_token_s=0.01, request_overhead_s=0.5)
    url = await nursery.start(serve_inference, config)
    # No client timeout: on the autojump clock it would fire while the model runs in a
    # worker thread (the loop is idle, so virtual time jumps to the nearest deadline).
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        before = trio.current_time()
        result = await _generate(client, _request(_prompt(10), None))
        elapsed = trio.current_time() - before
    tokens = len(result["choices"][0]["token_ids"])
    assert elapsed == pytest.approx(0.5 + 0.01 * tokens)


async def test_payload_faults_hit_only_the_first_of_several_choices(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, faults=FaultRates(payload_error=1.0))
    result = await _generate(client, _request(_prompt(10), tmp_path / "v0", n=3))
    first, *others = result["choices"]
    assert first["payload"] is None
    assert first["payload_error"]
    for choice in others:
        assert "payload_error" not in choice
        assert [segment["field"] for segment in choice["payload"]] == list(FIELDS)
    assert len(list((tmp_path / "v0").iterdir())) == 2


def test_the_run_config_sets_the_reply_options(tmp_path: Path) -> None:
    config = Config(
        run_dir=tmp_path,
        inference=InferenceConfig(model="Qwen/Qwen3-30B-A3B"),
        sim=SimConfig(
            inference_servers=2,
            reply_form="upstream",
            capture_routed_experts=False,
            capture_sampling_mask=False,
            payload_digests=True,
        ),
    )
    server = sim_inference_config(config, 1)
    assert server.served_model_name == "Qwen/Qwen3-30B-A3B"
    assert server.reply_form == "upstream"
    assert not server.capture_routed_experts
    assert not server.capture_sampling_mask
    assert server.payload_digests
    default = sim_inference_config(Config(run_dir=tmp_path, sim=SimConfig(inference_servers=1)), 0)
    assert default.served_model_name == "sim-moe"
    assert default.reply_form == "prime-rl"
    assert default.capture_routed_experts and default.capture_sampling_mask
    assert not default.payload_digests
