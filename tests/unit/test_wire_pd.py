"""Disaggregated prefill/decode replies by handle (orchestrator/wire/generate.py): the
router forwards both sides' segments, the prefill side's first; the daemon keeps the
prefill's rows for the prompt and the decode's for the rest, refuses every list that
does not fit that shape, and later checks on disk that the row both sides computed is the
same (`check_turn_files`, `overlap_problem`). Every file a side names is the daemon's to
delete, and none outside the request's `payload_dir` is ever accepted.

Replies are built here from the peers' schemas (segments as prime-rl writes them), and
the files with the daemon's own writer, so the bytes are real.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from payload_gc import PayloadRootFiles

from orchestrator.core.rollouts import GroupResult, RolloutResult
from orchestrator.core.samples import build_sample
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import check_turn_files
from orchestrator.payload import (
    PayloadSegment,
    RoutingShape,
    overlap_problem,
    overlap_rows,
    read_rows,
    read_sample_payload,
    stitch_inline_routing,
    write_payload_file,
)
from orchestrator.wire import parse_generate_response

FIELDS = ("routed_experts", "sampling_mask")
PROMPT_LEN = 10
COMPLETION = [5, 6, 7, 8]
ROUTING_END = PROMPT_LEN + len(COMPLETION) - 1  # 13: the last token run forward, + 1
LAYERS, TOP_K = 2, 3
START = 4  # routed_experts_prompt_start


def ids(first: int, stop: int, dtype: str = "uint8") -> np.ndarray:
    """The routing of positions first..stop-1: a function of the position alone, as a
    batch-invariant model's is of its prefix, so both sides agree on a shared row."""
    positions = np.arange(first, stop)[:, None, None]
    values = (positions * 7 + np.arange(LAYERS)[:, None] * 3 + np.arange(TOP_K)) % 200
    return values.astype(dtype)


def mask(rows: int) -> np.ndarray:
    return np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)


def wire(segment: PayloadSegment, payload_dir: Path) -> dict[str, Any]:
    return {
        "field": segment.field,
        "file": f"{payload_dir}/{segment.file}",
        "offset": segment.offset,
        "pos": segment.pos,
        "rows": segment.rows,
        "dtype": segment.dtype,
        "shape": list(segment.shape[1:]),
    }


def side_segments(
    payload_dir: Path, arrays: dict[str, tuple[np.ndarray, int]]
) -> list[dict[str, Any]]:
    """One side's file, written, and its wire segments."""
    return [wire(s, payload_dir) for s in write_payload_file(payload_dir, arrays)]


def prefill_side(payload_dir: Path, *, dtype: str = "uint8") -> list[dict[str, Any]]:
    """A prefill server's segments: the prompt's rows from the requested start, and the
    mask of the one token it sampled (thrown away by the router)."""
    return side_segments(
        payload_dir,
        {
            "routed_experts": (ids(START, PROMPT_LEN, dtype), START),
            "sampling_mask": (mask(1), PROMPT_LEN),
        },
    )


def decode_side(
    payload_dir: Path, *, first: int = PROMPT_LEN - 1, dtype: str = "uint8"
) -> list[dict[str, Any]]:
    """A decode server's segments: rows from its first forward pass (the prompt's last
    token) to the last token run forward, and the completion's mask."""
    return side_segments(
        payload_dir,
        {
            "routed_experts": (ids(first, ROUTING_END, dtype), first),
            "sampling_mask": (mask(len(COMPLETION)), PROMPT_LEN),
        },
    )


def reply(segments: Sequence[dict[str, Any]], **extra: Any) -> bytes:
    choice = {
        "index": 0,
        "token_ids": COMPLETION,
        "finish_reason": "length",
        "logprobs": None,
        "completion_logprobs": None,
        "routed_experts": None,
        "sampling_mask": None,
        "payload": list(segments),
        **extra,
    }
    choice["logprobs"] = {
        "content": [{"token": f"token_id:{t}", "logprob": -1.0} for t in COMPLETION]
    }
    return json.dumps({"request_id": "r", "choices": [choice]}).encode()


def parse(
    body: bytes,
    payload_dir: Path,
    *,
    fields: Sequence[str] = FIELDS,
    shape: RoutingShape | None = None,
) -> TurnOutput:
    return parse_generate_response(
        body,
        prompt_len=PROMPT_LEN,
        routing_start=START,
        payload_dir=payload_dir,
        fields=fields,
        routing_shape=shape,
    )


@pytest.fixture
def payload_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "payloads" / "v0"
    directory.mkdir(parents=True)
    return directory


def names(segments: Sequence[dict[str, Any]]) -> set[str]:
    return {segment["file"] for segment in segments}


def on_disk_problem(turn: TurnOutput, payload_dir: Path) -> str | None:
    with PayloadRootFiles(payload_dir.parent) as files:
        return check_turn_files(turn, files=files, version=0).problem


# --- accepted ----------------------------------------------------------------------------


def test_both_sides_segments_make_one_turn_with_every_file_known(payload_dir: Path) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is None
    assert turn.prefill_routing is not None
    assert (turn.prefill_routing.pos, turn.prefill_routing.rows) == (START, PROMPT_LEN - START)
    # The decode side's segments are the turn's: its routing and its completion's mask.
    routing, kept_mask = turn.segments["routed_experts"], turn.segments["sampling_mask"]
    assert (routing.pos, routing.rows) == (PROMPT_LEN - 1, len(COMPLETION))
    assert (kept_mask.pos, kept_mask.rows) == (PROMPT_LEN, len(COMPLETION))
    assert routing.file == Path(decode[0]["file"]).name
    # Both files, the prefill's mask-only bytes included, go with the rollout.
    assert turn.files == names(prefill) | names(decode)
    assert on_disk_problem(turn, payload_dir) is None


def test_the_stitched_sample_equals_the_routers_inline_merge(payload_dir: Path) -> None:
    """Prefill's rows up to the prompt's end, decode's after: what the router's inline
    merge gives, bitwise (dtype promoted as the router widens uint8 and uint16)."""
    # Turn 0: a 2-token prompt and 3 sampled tokens, rows 0..3, so turn 1 (the P/D
    # one: 2 + 3 + 5 environment tokens = PROMPT_LEN) asks for rows from START = 4.
    head = write_payload_file(payload_dir, {"routed_experts": (ids(0, START), 0)})[0]
    turn0 = TurnOutput(
        [11, 12, 13],
        [-1.0] * 3,
        "length",
        segments={"routed_experts": head},
        files=frozenset({f"{payload_dir}/{head.file}"}),
    )
    prefill = prefill_side(payload_dir, dtype="uint8")
    decode = decode_side(payload_dir, dtype="uint16")
    turn1 = parse(reply([*prefill, *decode]), payload_dir)
    assert turn1.poisoned is None
    tokens = [1, 2, 11, 12, 13, 20, 21, 22, 23, 24, *COMPLETION]
    sample, dropped = build_sample(
        "r",
        tokens,
        [(2, turn0), (PROMPT_LEN, turn1)],
        payload_dir=payload_dir,
        fields=("routed_experts",),
        final_token_route="repeat",
    )
    assert not dropped and sample.untrainable is None
    assert sample.files == {f"{payload_dir}/{head.file}"} | names(prefill) | names(decode)
    by_handle = read_sample_payload(payload_dir, sample.payload, len(tokens))["routed_experts"]
    # The router's inline merge of turn 1: the prefill's rows, then the decode's after as
    # many (its leading ones are padding and the shared row), widened to uint16.
    merged = np.concatenate(
        [ids(START, PROMPT_LEN, "uint16"), ids(PROMPT_LEN, ROUTING_END, "uint16")]
    )
    inline = stitch_inline_routing([(ids(0, START), 0), (merged, START)], len(tokens), "repeat")
    assert inline is not None
    assert by_handle.dtype == inline.dtype == np.uint16
    assert np.array_equal(by_handle, inline)


def test_a_router_that_clips_the_shared_row_is_accepted(payload_dir: Path) -> None:
    # PrimeIntellect-ai/router's by-handle draft drops the decode's rows the prefill
    # covers: the decode's segment starts at the prompt's end, nothing is left to check.
    prefill = prefill_side(payload_dir)[:1]
    decode = decode_side(payload_dir)
    routing = decode[0]
    row_bytes = LAYERS * TOP_K
    decode[0] = {**routing, "offset": routing["offset"] + row_bytes, "pos": PROMPT_LEN, "rows": 3}
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is None
    assert turn.segments["routed_experts"].pos == PROMPT_LEN
    assert on_disk_problem(turn, payload_dir) is None


def test_a_one_token_completion_whose_decode_rows_were_clipped_away(payload_dir: Path) -> None:
    # With one completion token the decode's only row is the shared one; a clipping router
    # drops it whole: the prefill's rows reach the last token run forward on their own.
    prefill = prefill_side(payload_dir)[:1]
    decode = side_segments(payload_dir, {"sampling_mask": (mask(1), PROMPT_LEN)})
    body = json.loads(reply([*prefill, *decode]))
    body["choices"][0]["token_ids"] = [5]
    body["choices"][0]["logprobs"]["content"] = body["choices"][0]["logprobs"]["content"][:1]
    turn = parse(json.dumps(body).encode(), payload_dir)
    assert turn.poisoned is None
    assert "routed_experts" not in turn.segments and turn.prefill_routing is not None


def test_masks_only_still_name_both_files(payload_dir: Path) -> None:
    prefill = side_segments(payload_dir, {"sampling_mask": (mask(1), PROMPT_LEN)})
    decode = side_segments(payload_dir, {"sampling_mask": (mask(4), PROMPT_LEN)})
    turn = parse(reply([*prefill, *decode]), payload_dir, fields=("sampling_mask",))
    assert turn.poisoned is None
    assert turn.segments["sampling_mask"].rows == 4
    assert turn.files == names(prefill) | names(decode)


# --- the shared row, on disk -------------------------------------------------------------


def test_a_shared_row_the_sides_disagree_on_poisons_the_turn(payload_dir: Path) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is None
    # The decode side's first row (the prompt's last token) says something else.
    path = Path(decode[0]["file"])
    data = bytearray(path.read_bytes())
    data[0] = (data[0] + 1) % 128
    path.write_bytes(bytes(data))
    problem = on_disk_problem(turn, payload_dir)
    assert problem is not None
    assert f"position {PROMPT_LEN - 1}" in problem and "disagree" in problem
    assert "\n" not in problem


def test_the_shared_row_is_compared_by_value_across_dtypes(payload_dir: Path) -> None:
    prefill = prefill_side(payload_dir, dtype="uint8")
    decode = decode_side(payload_dir, dtype="uint16")
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is None
    assert on_disk_problem(turn, payload_dir) is None


def test_a_missing_side_file_is_a_problem_not_a_crash(payload_dir: Path) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    turn = parse(reply([*prefill, *decode]), payload_dir)
    Path(prefill[0]["file"]).unlink()
    problem = on_disk_problem(turn, payload_dir)
    assert problem is not None and "missing" in problem


def test_overlap_helpers(payload_dir: Path) -> None:
    a = write_payload_file(payload_dir, {"routed_experts": (ids(2, 8), 2)})[0]
    b = write_payload_file(payload_dir, {"routed_experts": (ids(6, 9, "uint16"), 6)})[0]
    assert overlap_rows(a, b) == range(6, 8)
    assert not overlap_rows(
        a, write_payload_file(payload_dir, {"routed_experts": (ids(8, 9), 8)})[0]
    )
    with PayloadRootFiles(payload_dir.parent) as files:
        directory = files.version(0)
        rows = read_rows(directory, b, 1, 2)
        assert rows.dtype == np.uint16 and np.array_equal(rows, ids(7, 9))
        assert overlap_problem(directory, a, b) is None
        with pytest.raises(ValueError, match="outside"):
            read_rows(directory, b, 2, 2)


# --- refused -----------------------------------------------------------------------------


def test_three_files_are_refused_and_all_of_them_known(payload_dir: Path) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    third = side_segments(payload_dir, {"sampling_mask": (mask(4), PROMPT_LEN)})
    turn = parse(reply([*prefill, *decode, *third]), payload_dir)
    assert turn.poisoned is not None and "3 files" in turn.poisoned
    assert turn.files == names(prefill) | names(decode) | names(third)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("prefill starts late", ("prefill routed_experts",)),
        ("prefill runs past the prompt", ("prefill routed_experts",)),
        ("gap between the sides", ("do not continue",)),
        ("decode stops early", ("do not continue",)),
        ("sides swapped", ("prefill routed_experts",)),
        ("prefill without routing", ("prefill side sent no routed_experts",)),
        ("two routings on one side", ("two segments for routed_experts from the prefill side",)),
        ("decode mask rows", ("sampling_mask rows",)),
    ],
)
def test_lists_that_do_not_fit_prefill_then_decode_are_refused(
    payload_dir: Path, case: str, words: tuple[str, ...]
) -> None:
    row_bytes = LAYERS * TOP_K
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    if case == "prefill starts late":
        prefill[0] = {**prefill[0], "pos": START + 1, "rows": PROMPT_LEN - START - 1}
    elif case == "prefill runs past the prompt":
        prefill[0] = {**prefill[0], "rows": PROMPT_LEN - START + 1}
    elif case == "gap between the sides":
        prefill[0] = {**prefill[0], "rows": PROMPT_LEN - START - 3}
        decode[0] = {**decode[0], "offset": row_bytes, "pos": PROMPT_LEN, "rows": 3}
    elif case == "decode stops early":
        decode[0] = {**decode[0], "rows": len(COMPLETION) - 1}
    elif case == "sides swapped":
        prefill, decode = decode, prefill
    elif case == "prefill without routing":
        prefill = prefill[1:]
    elif case == "two routings on one side":
        prefill = [prefill[0], prefill[0], prefill[1]]
    else:
        decode[1] = {**decode[1], "rows": len(COMPLETION) - 1}
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is not None
    for word in words:
        assert word in turn.poisoned, turn.poisoned
    assert "\n" not in turn.poisoned
    # Whatever is wrong, every file a well-formed segment names is offered for deletion.
    assert turn.files == names(prefill) | names(decode)


def test_routing_of_another_model_on_either_side_is_refused(payload_dir: Path) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    turn = parse(reply([*prefill, *decode]), payload_dir, shape=RoutingShape(LAYERS, TOP_K))
    assert turn.poisoned is None
    decode[0] = {**decode[0], "shape": [TOP_K, LAYERS]}
    turn = parse(reply([*prefill, *decode]), payload_dir, shape=RoutingShape(LAYERS, TOP_K))
    assert turn.poisoned is not None


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("where", ["traversal", "absolute", "other version", "subdirectory"])
def test_a_file_outside_payload_dir_on_either_side_is_refused_and_never_named(
    payload_dir: Path, side: str, where: str
) -> None:
    prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
    victim = prefill if side == "prefill" else decode
    outside = {
        "traversal": f"{payload_dir}/../../outside/x.bin",
        "absolute": "/etc/passwd",
        "other version": f"{payload_dir.parent}/v1/x.bin",
        "subdirectory": f"{payload_dir}/sub/x.bin",
    }[where]
    victim[0] = {**victim[0], "file": outside}
    turn = parse(reply([*prefill, *decode]), payload_dir)
    assert turn.poisoned is not None and "bad segment" in turn.poisoned
    assert all(path.startswith(f"{payload_dir}/") for path in turn.files)
    assert outside not in turn.files
    assert all("/" not in path.removeprefix(f"{payload_dir}/") for path in turn.files)


def test_a_side_payload_error_poisons_and_keeps_the_other_sides_file(payload_dir: Path) -> None:
    decode = decode_side(payload_dir)
    turn = parse(reply(decode, payload_error="prefill: disk full"), payload_dir)
    assert turn.poisoned is not None and "prefill: disk full" in turn.poisoned
    assert turn.files == names(decode)


def test_a_decode_side_alone_says_what_the_router_may_have_dropped(payload_dir: Path) -> None:
    # A router that merges only inline passes the decode's segments on and drops the
    # prefill's: the rows start at the decode's first forward pass, not where asked.
    turn = parse(reply(decode_side(payload_dir)), payload_dir)
    assert turn.poisoned is not None
    assert "prefill" in turn.poisoned and "router" in turn.poisoned


# --- discards ----------------------------------------------------------------------------


def test_a_discarded_pd_rollout_gives_both_sides_files_for_deletion(payload_dir: Path) -> None:
    """The files the sink hands back for deletion when a group is discarded (here: every
    reward equal, no learning signal) are every file both sides of every turn wrote."""
    rollouts = []
    written: set[str] = set()
    for index in range(2):
        prefill, decode = prefill_side(payload_dir), decode_side(payload_dir)
        written |= names(prefill) | names(decode)
        turn = parse(reply([*prefill, *decode]), payload_dir)
        tokens = list(range(PROMPT_LEN)) + COMPLETION
        sample, _ = build_sample(
            f"g-r{index}",
            tokens,
            [(PROMPT_LEN, turn)],
            payload_dir=payload_dir,
            fields=FIELDS,
            final_token_route="repeat",
        )
        rollouts.append(
            RolloutResult(f"g-r{index}", 0, reward=1.0, samples=(sample,), files=turn.files)
        )
    limits = SinkLimits(
        batch_size=4,
        constant_size=True,
        staleness=Staleness(2),
        curriculum_min_mean_reward=0.0,
        curriculum_max_mean_reward=1.0,
        max_seq_len=64,
    )
    sink = TrainSink(limits)
    deleted = sink.admit(GroupResult("g", 0, tuple(rollouts)), next_step=1)
    assert sink.counters["no_signal"] == 2
    assert set(deleted) == written and len(written) == 4
