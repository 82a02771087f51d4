"""The simulated inference server over real loopback HTTP, with real payload files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from orchestrator.payload import PayloadSegment, decode_inline, payload_digest
from orchestrator.sim import (
    FaultRates,
    SamplingParams,
    SimInferenceConfig,
    SimModel,
    prefix_hashes,
    sample_completion,
    serve_inference,
)

GENERATE = "/inference/v1/generate"
# A small model keeps the tests fast; the benchmark runs the default 48-layer shape.
MODEL = SimModel(layers=6, num_experts=64, top_k=4, vocab_size=1000)


async def _start(nursery: trio.Nursery, **changes: Any) -> httpx.AsyncClient:
    config = SimInferenceConfig(model=MODEL, **changes)
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
    tokens: list[int], payload_dir: Path | None, *, seed: int = 7, n: int = 1
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": 48,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 20,
        "seed": seed,
        "n": n,
    }
    if payload_dir is not None:
        params["extra_args"] = {"payload_dir": str(payload_dir)}
    return {
        "request_id": f"req-{seed}",
        "token_ids": tokens,
        "sampling_params": params,
        "return_routed_experts": True,
        "return_sampling_mask": True,
    }


def _prompt(count: int, seed: int = 0) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(0, 1000, count).tolist()
    return tokens


def _read_segment(payload_dir: Path, obj: dict[str, Any]) -> np.ndarray:
    """A segment's array, read with plain numpy at its offset, shape and dtype."""
    segment = PayloadSegment.from_json(obj)
    path = payload_dir / segment.file
    count = int(np.prod(segment.shape))
    array = np.fromfile(path, dtype=np.dtype(segment.dtype), count=count, offset=segment.offset)
    with path.open("rb") as f:
        f.seek(segment.offset)
        assert payload_digest(f.read(segment.nbytes)) == segment.digest
    return array.reshape(segment.shape)


def _open_paths() -> set[str]:
    """Files this process has open (the server runs in-process)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return paths


async def _generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def test_by_handle_arrays_equal_inline_arrays(nursery: trio.Nursery, tmp_path: Path) -> None:
    # Two servers with cold prefix caches, so both answer from position 0.
    by_handle_client = await _start(nursery)
    inline_client = await _start(nursery)
    payload_dir = tmp_path / "payloads" / "v3"
    prompt = _prompt(300)
    handle = await _generate(by_handle_client, _request(prompt, payload_dir))
    inline = await _generate(inline_client, _request(prompt, None))

    [choice] = handle["choices"]
    [inline_choice] = inline["choices"]
    assert choice["token_ids"] == inline_choice["token_ids"]
    assert choice["logprobs"] == inline_choice["logprobs"]
    assert choice["routed_experts_prompt_start"] == 0
    assert choice["prompt_len"] == 300
    assert "routed_experts" not in choice
    assert "payload" not in inline_choice
    completion_len = len(choice["token_ids"])

    routed_segment, mask_segment = choice["payload"]
    assert routed_segment["field"] == "routed_experts"
    assert routed_segment["file"] == mask_segment["file"]
    assert routed_segment["offset"] == 0
    assert routed_segment["shape"] == [300 + completion_len - 1, 6, 4]
    assert routed_segment["dtype"] == "uint8"
    assert mask_segment["pos"] == 300
    assert mask_segment["offset"] == routed_segment["shape"][0] * 6 * 4
    assert (payload_dir / routed_segment["file"]).stat().st_size == (
        mask_segment["offset"] + mask_segment["shape"][0] * mask_segment["shape"][1] * 4
    )

    routed, pos = decode_inline(inline_choice["routed_experts"], field="routed_experts")
    assert pos == 0
    np.testing.assert_array_equal(_read_segment(payload_dir, routed_segment), routed)
    assert _read_segment(payload_dir, routed_segment).dtype == routed.dtype
    mask, mask_pos = decode_inline(inline_choice["sampling_mask"], field="sampling_mask")
    assert mask_pos == 300
    np.testing.assert_array_equal(_read_segment(payload_dir, mask_segment), mask)

    # The server's completion is the model's, recomputed here from the request alone.
    params = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, top_k=20, seed=7)
    expected = sample_completion(MODEL, int(prefix_hashes(prompt)[-1]), params, 0)
    assert choice["token_ids"] == expected.token_ids.tolist()
    np.testing.assert_array_equal(mask, expected.sampling_mask)
    assert handle["usage"] == {
        "prompt_tokens": 300,
        "completion_tokens": completion_len,
        "total_tokens": 300 + completion_len,
    }


async def test_second_turn_starts_past_the_cached_prefix(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    by_handle_client = await _start(nursery)
    inline_client = await _start(nursery)
    payload_dir = tmp_path / "v0"
    turn1_prompt = _prompt(100)
    turn1 = await _generate(by_handle_client, _request(turn1_prompt, payload_dir))
    await _generate(inline_client, _request(turn1_prompt, None))
    completion = turn1["choices"][0]["token_ids"]
    turn2_prompt = turn1_prompt + completion + _prompt(20, seed=1)
    turn2 = await _generate(by_handle_client, _request(turn2_prompt, payload_dir, seed=8))
    turn2_inline = await _generate(inline_client, _request(turn2_prompt, None, seed=8))

    [choice] = turn2["choices"]
    start = choice["routed_experts_prompt_start"]
    # Turn 1 computed 100 + len(completion) - 1 positions: every whole block of them is cached.
    assert start == (100 + len(completion) - 1) // 16 * 16
    assert start > 0
    assert turn2_inline["choices"][0]["routed_experts_prompt_start"] == start
    routed_segment, _ = choice["payload"]
    assert routed_segment["pos"] == start
    turn2_rows = _read_segment(payload_dir, routed_segment)
    inline_rows, _ = decode_inline(
        turn2_inline["choices"][0]["routed_experts"], field="routed_experts"
    )
    np.testing.assert_array_equal(turn2_rows, inline_rows)
    # A server with a cold cache recomputes every position: those of turn 1 route as they
    # did in turn 1.
    cold_client = await _start(nursery)
    cold = await _generate(cold_client, _request(turn2_prompt, None, seed=8))
    assert cold["choices"][0]["routed_experts_prompt_start"] == 0
    cold_rows, _ = decode_inline(cold["choices"][0]["routed_experts"], field="routed_experts")
    turn1_rows = _read_segment(payload_dir, turn1["choices"][0]["payload"][0])
    np.testing.assert_array_equal(cold_rows[: turn1_rows.shape[0]], turn1_rows)
    np.testing.assert_array_equal(cold_rows[start:], turn2_rows)


async def test_payload_file_is_closed_and_present_when_the_response_arrives(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, fsync=True)
    payload_dir = tmp_path / "v1"
    result = await _generate(client, _request(_prompt(64), payload_dir, n=3))
    files = {choice["payload"][0]["file"] for choice in result["choices"]}
    assert len(files) == 3, "one file per choice"
    assert {path.name for path in payload_dir.iterdir()} == files
    open_now = _open_paths()
    for name in files:
        assert str(payload_dir / name) not in open_now
    assert [choice["index"] for choice in result["choices"]] == [0, 1, 2]
    health = (await client.get("/health")).json()
    assert health["payload_files_written"] == 3
    assert health["payload_bytes_written"] == sum(
        (payload_dir / name).stat().st_size for name in files
    )


async def test_by_handle_without_requested_fields_writes_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery)
    body = _request(_prompt(10), tmp_path / "v0")
    body["return_routed_experts"] = body["return_sampling_mask"] = False
    result = await _generate(client, body)
    assert result["choices"][0]["payload"] == []
    assert not (tmp_path / "v0").exists()


async def test_update_weights_and_health(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery)
    health = (await client.get("/health")).json()
    assert health["version"] == 0
    assert health["requests_served"] == 0
    assert health["in_flight"] == 0

    prompt = _prompt(80)
    await _generate(client, _request(prompt, None))
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
    # New weights invalidate the prefix cache: the same prompt routes from 0 again.
    again = await _generate(client, _request(prompt, None))
    assert again["choices"][0]["routed_experts_prompt_start"] == 0

    bad = await client.post("/update_weights", json={"weight_dir": 5})
    assert bad.status_code == 400
    assert "weight_dir" in bad.json()["error"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "not JSON"),
        (b'{"request_id": "x"}', "token_ids"),
        (b'{"request_id": "x", "token_ids": [1], "sampling_params": {}}', "max_tokens"),
    ],
)
async def test_bad_body_gets_400_with_a_json_error(
    nursery: trio.Nursery, body: bytes, message: str
) -> None:
    client = await _start(nursery)
    response = await client.post(GENERATE, content=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


async def test_unknown_route_and_method(nursery: trio.Nursery) -> None:
    client = await _start(nursery)
    assert (await client.get("/nope")).status_code == 404
    assert (await client.get(GENERATE)).status_code == 405


async def test_http_500_fault(nursery: trio.Nursery, tmp_path: Path) -> None:
    client = await _start(nursery, faults=FaultRates(http_500=1.0))
    response = await client.post(GENERATE, json=_request(_prompt(10), tmp_path / "v0"))
    assert response.status_code == 500
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


async def test_bad_segment_fault_gives_traversal_or_offset_past_the_end(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, faults=FaultRates(bad_segment=1.0), fault_seed=3)
    payload_dir = tmp_path / "v0"
    seen = set()
    for seed in range(12):
        result = await _generate(client, _request(_prompt(20), payload_dir, seed=seed))
        segment = result["choices"][0]["payload"][0]
        if segment["file"] == "../../etc/x.bin":
            seen.add("traversal")
        else:
            size = (payload_dir / segment["file"]).stat().st_size
            nbytes = int(np.prod(segment["shape"]))  # uint8 routing ids
            assert segment["offset"] + nbytes > size
            seen.add("past_end")
    assert seen == {"traversal", "past_end"}
    assert (await client.get("/health")).json()["faults"]["bad_segment"] == 12


async def test_payload_error_fault_carries_no_payload(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery, faults=FaultRates(payload_error=1.0))
    result = await _generate(client, _request(_prompt(10), tmp_path / "v0"))
    [choice] = result["choices"]
    assert "payload" not in choice
    assert "fault" in choice["payload_error"]
    assert choice["token_ids"]
    assert (await client.get("/health")).json()["faults"]["payload_error"] == 1


async def test_unwritable_payload_dir_reports_payload_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    client = await _start(nursery)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = await _generate(client, _request(_prompt(10), blocker / "v0"))
    [choice] = result["choices"]
    assert "payload" not in choice
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
    assert "payload" not in first
    assert first["payload_error"]
    for choice in others:
        assert "payload_error" not in choice
        assert [segment["field"] for segment in choice["payload"]] == [
            "routed_experts",
            "sampling_mask",
        ]
    assert len(list((tmp_path / "v0").iterdir())) == 2
