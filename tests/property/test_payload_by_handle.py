"""By handle equals inline: random multi-turn branches, stitched both ways, bitwise equal.

Each example builds a branch (turns with growing prompts, prefix-cache starts, completion
lengths), writes every turn's payload through the real writer, keeps the same arrays
inline, picks a sample length (clipping the branch), and checks that:

* stitching file segments and reading them gives exactly the stitched inline arrays
  (dtype included), for both final-token rules, whole and in row windows;
* both agree with a position-by-position oracle (first turn covering a position wins);
* routing is dropped (None) exactly when some position ``0 .. L-2`` has no row.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from orchestrator.payload import (
    FinalTokenRoute,
    PayloadSegment,
    read_sample_payload,
    stitch_inline_masks,
    stitch_inline_routing,
    stitch_masks,
    stitch_routing,
    write_payload_file,
)


@attrs.frozen
class Turn:
    prompt_len: int
    completion_len: int
    start: int  # routed_experts_prompt_start: rows before it came from the prefix cache

    @property
    def routing_rows(self) -> int:
        # Positions start .. prompt_len + completion_len - 2: the last token never ran.
        return self.prompt_len + self.completion_len - 1 - self.start


@attrs.frozen
class Branch:
    turns: tuple[Turn, ...]
    num_experts: int
    layers: int
    top_k: int
    seed: int

    @property
    def length(self) -> int:
        last = self.turns[-1]
        return last.prompt_len + last.completion_len


@st.composite
def branches(draw: st.DrawFn) -> Branch:
    turns: list[Turn] = []
    prompt_len = draw(st.integers(1, 8))
    covered = 0  # positions 0 .. covered - 1 have rows from earlier turns
    for _ in range(draw(st.integers(1, 4))):
        completion_len = draw(st.integers(1, 6))
        # Mostly cache hits within what earlier turns covered; sometimes past it (a gap,
        # unless a later turn fills it) or up to the whole prompt.
        if draw(st.integers(0, 3)):
            start = draw(st.integers(0, min(covered, prompt_len)))
        else:
            start = draw(st.integers(0, prompt_len))
        turns.append(Turn(prompt_len, completion_len, start))
        covered = max(covered, prompt_len + completion_len - 1)
        prompt_len += completion_len + draw(st.integers(0, 4))
    return Branch(
        turns=tuple(turns),
        num_experts=draw(st.sampled_from([8, 256, 300, 4096])),
        layers=draw(st.integers(1, 3)),
        top_k=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def turn_arrays(branch: Branch) -> list[dict[str, tuple[np.ndarray, int]]]:
    rng = np.random.default_rng(branch.seed)
    dtype = np.uint8 if branch.num_experts <= 256 else np.uint16
    out = []
    for turn in branch.turns:
        routing = rng.integers(
            0, branch.num_experts, size=(turn.routing_rows, branch.layers, branch.top_k)
        ).astype(dtype)
        width = int(rng.integers(1, 5))
        mask = rng.integers(-1, 100_000, size=(turn.completion_len, width)).astype(np.int32)
        out.append(
            {"routed_experts": (routing, turn.start), "sampling_mask": (mask, turn.prompt_len)}
        )
    return out


def oracle_routing(
    arrays: list[dict[str, tuple[np.ndarray, int]]], sample_len: int, route: FinalTokenRoute
) -> np.ndarray | None:
    rows: list[np.ndarray] = []
    for position in range(sample_len - 1):
        for turn in arrays:
            routing, pos = turn["routed_experts"]
            if pos <= position < pos + len(routing):
                rows.append(routing[position - pos])
                break
        else:
            return None
    template = arrays[0]["routed_experts"][0]
    if route == "repeat":
        if not rows:
            return None
        return np.stack([*rows, rows[-1]])
    wide = np.promote_types(template.dtype, np.int8)
    sentinel = np.full(template.shape[1:], -1, dtype=wide)
    return np.stack([*(r.astype(wide) for r in rows), sentinel])


@settings(max_examples=60, deadline=None)
@given(branch=branches(), data=st.data())
def test_by_handle_equals_inline(branch: Branch, data: st.DataObject) -> None:
    sample_len = data.draw(st.integers(1, branch.length), label="sample_len")
    arrays = turn_arrays(branch)
    with tempfile.TemporaryDirectory() as tmp:
        payload_dir = Path(tmp) / "v0"
        written = [write_payload_file(payload_dir, turn) for turn in arrays]
        # The segments travel as JSON (response, then batch) before the trainer reads them.
        wire = [[PayloadSegment.from_json(s.to_json()) for s in turn] for turn in written]
        # Inline, a turn's arrays are what its reply decodes to (orchestrator.wire).
        inline = [{field: (a.copy(), pos) for field, (a, pos) in t.items()} for t in arrays]
        routed_segments = [segments[0] for segments in wire]
        mask_segments = [segments[1] for segments in wire]
        inline_masks = stitch_inline_masks([t["sampling_mask"] for t in inline], sample_len)
        stitched_masks = stitch_masks(mask_segments, sample_len)
        for route in ("repeat", "sentinel"):
            handle = stitch_routing(routed_segments, sample_len, route)
            expected = stitch_inline_routing(
                [t["routed_experts"] for t in inline], sample_len, route
            )
            oracle = oracle_routing(arrays, sample_len, route)
            assert (handle is None) == (expected is None) == (oracle is None)
            event(f"{route}: routing {'dropped' if handle is None else 'kept'}")
            segments = {"sampling_mask": stitched_masks}
            if handle is not None:
                assert expected is not None
                assert oracle is not None
                assert expected.dtype == oracle.dtype
                assert np.array_equal(expected, oracle)
                segments["routed_experts"] = [PayloadSegment.from_json(s.to_json()) for s in handle]
            read = read_sample_payload(payload_dir, segments, sample_len, verify=True)
            assert read["sampling_mask"].dtype == np.int32
            assert np.array_equal(read["sampling_mask"], inline_masks)
            if expected is not None:
                assert read["routed_experts"].dtype == expected.dtype
                assert read["routed_experts"].tobytes() == expected.tobytes()
            start = data.draw(st.integers(0, sample_len), label="window start")
            stop = data.draw(st.integers(start, sample_len), label="window stop")
            window = read_sample_payload(payload_dir, segments, sample_len, rows=range(start, stop))
            for field, array in read.items():
                assert window[field].dtype == array.dtype
                assert np.array_equal(window[field], array[start:stop])


@settings(max_examples=40, deadline=None)
@given(branch=branches(), data=st.data())
def test_masks_match_an_oracle(branch: Branch, data: st.DataObject) -> None:
    sample_len = data.draw(st.integers(1, branch.length), label="sample_len")
    arrays = turn_arrays(branch)
    masks = [turn["sampling_mask"] for turn in arrays]
    out = stitch_inline_masks(masks, sample_len)
    kept = [m for m, pos in masks if pos < sample_len]
    assert out.shape == (sample_len, max((m.shape[1] for m in kept), default=0))
    for position in range(sample_len):
        for mask, pos in masks:
            if pos <= position < pos + len(mask):
                width = mask.shape[1]
                assert np.array_equal(out[position, :width], mask[position - pos])
                assert (out[position, width:] == -1).all()
                break
        else:
            assert (out[position] == -1).all()
