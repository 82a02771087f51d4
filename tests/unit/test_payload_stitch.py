"""Stitching turns into a sample: the plan, clipped segments and their digests."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.payload import (
    BadSegment,
    Clip,
    PayloadSegment,
    plan_routing,
    stitch_inline_masks,
    stitch_inline_routing,
    stitch_masks,
    stitch_routing,
)

DIGEST_A = "a" * 32
DIGEST_B = "b" * 32


def routed(pos: int, rows: int, *, file: str = "a.bin", offset: int = 0) -> PayloadSegment:
    digest = DIGEST_A if file == "a.bin" else DIGEST_B
    return PayloadSegment("routed_experts", file, offset, pos, (rows, 2, 3), "uint8", digest)


def test_plan_first_turn_wins_and_later_turns_start_after_it() -> None:
    # Turn 0: prompt 4 + 3 sampled -> rows for 0..5; turn 1 prompt 9 (cached up to 4).
    assert plan_routing([(0, 6), (4, 8)], 12) == [
        Clip(turn=0, first_row=0, rows=6, pos=0),
        Clip(turn=1, first_row=2, rows=5, pos=6),
    ]


def test_plan_clips_to_the_sample() -> None:
    assert plan_routing([(0, 6), (4, 8)], 5) == [Clip(0, 0, 4, 0)]
    assert plan_routing([(0, 6), (4, 8)], 7) == [Clip(0, 0, 6, 0)]
    assert plan_routing([(0, 6), (4, 8)], 8) == [Clip(0, 0, 6, 0), Clip(1, 2, 1, 6)]


def test_plan_gaps() -> None:
    assert plan_routing([(0, 4), (5, 8)], 10) is None  # position 4 has no row
    assert plan_routing([(1, 9)], 5) is None  # position 0 was cached and not returned
    assert plan_routing([(0, 4), (5, 8)], 5) == [Clip(0, 0, 4, 0)]  # the gap is past L-2
    assert plan_routing([], 1) == []
    assert plan_routing([], 2) is None


def test_plan_a_later_turn_may_fill_an_earlier_hole() -> None:
    # Turn 1 came from a prefix cache hit past turn 0's rows; turn 2 recomputed them.
    assert plan_routing([(0, 4), (8, 4), (2, 20)], 12) == [
        Clip(0, 0, 4, 0),
        Clip(2, 2, 4, 4),
        Clip(1, 0, 3, 8),
    ]


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="sample_len"):
        plan_routing([(0, 3)], 0)
    with pytest.raises(ValueError, match="negative"):
        plan_routing([(-1, 3)], 2)


def test_stitch_routing_repeat() -> None:
    turn0 = routed(0, 6, offset=0)
    turn1 = routed(4, 8, file="b.bin", offset=100)
    stitched = stitch_routing([turn0, turn1], 12, "repeat")
    assert stitched is not None
    row = 6  # bytes per row
    assert stitched[0] == turn0  # unclipped: the segment as the server wrote it
    clipped = stitched[1]
    assert (clipped.file, clipped.pos, clipped.rows) == ("b.bin", 6, 5)
    assert clipped.offset == 100 + 2 * row
    assert (clipped.digest, clipped.digest_range) == (DIGEST_B, (100, 8 * row))
    final = stitched[2]
    # Row 10 is the last row of the clip: turn 1's row 6, at offset 100 + 6 * row.
    assert (final.file, final.pos, final.rows, final.offset) == ("b.bin", 11, 1, 100 + 6 * row)
    assert final.digest_range == (100, 8 * row)
    assert [s.pos for s in stitched] == [0, 6, 11]
    assert sum(s.rows for s in stitched) == 12


def test_stitch_routing_sentinel() -> None:
    stitched = stitch_routing([routed(0, 6)], 4, "sentinel")
    assert stitched is not None
    assert stitched[0].rows == 3
    assert stitched[0].digest_range == (0, 36)
    fill = stitched[1]
    assert (fill.file, fill.pos, fill.shape, fill.fill, fill.dtype) == (
        "",
        3,
        (1, 2, 3),
        -1,
        "uint8",
    )


def test_clipping_a_clipped_segment_keeps_the_original_digest_range() -> None:
    first = stitch_routing([routed(0, 10, offset=40)], 8, "repeat")
    assert first is not None
    again = stitch_routing(first[:1], 5, "repeat")
    assert again is not None
    assert all(s.digest_range == (40, 60) for s in again)
    assert again[1].offset == 40 + 3 * 6


def test_stitch_routing_none_cases() -> None:
    assert stitch_routing([routed(0, 3), routed(4, 3)], 7, "repeat") is None
    assert stitch_routing([routed(0, 3)], 1, "repeat") is None  # no row L-2 to repeat
    one = stitch_routing([routed(0, 3)], 1, "sentinel")
    assert one is not None
    assert [(s.pos, s.fill) for s in one] == [(0, -1)]
    assert stitch_routing([], 1, "sentinel") is None


def test_stitch_routing_rejects_inconsistent_turns() -> None:
    other = PayloadSegment("routed_experts", "b.bin", 0, 3, (4, 2, 4), "uint8", DIGEST_B)
    with pytest.raises(BadSegment) as info:
        stitch_routing([routed(0, 4), other], 6, "repeat")
    assert info.value.reason == "shape"
    with pytest.raises(ValueError, match="routed_experts"):
        stitch_routing(
            [PayloadSegment("sampling_mask", "a", 0, 0, (1, 1), "int32", "")], 2, "repeat"
        )


def test_stitch_inline_routing() -> None:
    turn0 = np.arange(6 * 2 * 3, dtype=np.uint8).reshape(6, 2, 3)
    turn1 = np.arange(8 * 2 * 3, dtype=np.uint8).reshape(8, 2, 3) + 100
    repeat = stitch_inline_routing([(turn0, 0), (turn1, 4)], 12, "repeat")
    assert repeat is not None
    assert repeat.dtype == np.uint8
    assert np.array_equal(repeat[:6], turn0)
    assert np.array_equal(repeat[6:11], turn1[2:7])
    assert np.array_equal(repeat[11], turn1[6])
    sentinel = stitch_inline_routing([(turn0, 0), (turn1, 4)], 12, "sentinel")
    assert sentinel is not None
    assert sentinel.dtype == np.int16
    assert np.array_equal(sentinel[:11], repeat[:11])
    assert (sentinel[11] == -1).all()
    wide = stitch_inline_routing([(turn0.astype(np.uint16), 0)], 3, "sentinel")
    assert wide is not None
    assert wide.dtype == np.int32
    assert stitch_inline_routing([(turn0, 1)], 3, "repeat") is None


def mask(pos: int, rows: int, width: int, file: str = "a.bin") -> PayloadSegment:
    return PayloadSegment("sampling_mask", file, 0, pos, (rows, width), "int32", DIGEST_A)


def test_stitch_masks_clips_the_tail() -> None:
    turn0, turn1 = mask(4, 3, 5), mask(9, 4, 2, "b.bin")
    assert stitch_masks([turn0, turn1], 20) == [turn0, turn1]
    clipped = stitch_masks([turn0, turn1], 11)
    assert [(s.file, s.pos, s.rows) for s in clipped] == [("a.bin", 4, 3), ("b.bin", 9, 2)]
    assert clipped[1].digest_range == (0, 32)
    assert stitch_masks([turn0, turn1], 6) == [
        PayloadSegment("sampling_mask", "a.bin", 0, 4, (2, 5), "int32", DIGEST_A, None, 0, 60)
    ]
    assert stitch_masks([turn0, turn1], 4) == []


def test_stitch_inline_masks() -> None:
    turn0 = np.arange(15, dtype=np.int32).reshape(3, 5)
    turn1 = np.arange(8, dtype=np.int32).reshape(4, 2) + 50
    out = stitch_inline_masks([(turn0, 4), (turn1, 9)], 11)
    assert out.shape == (11, 5)
    assert out.dtype == np.int32
    assert (out[:4] == -1).all()
    assert np.array_equal(out[4:7], turn0)
    assert (out[7:9] == -1).all()
    assert np.array_equal(out[9:11, :2], turn1[:2])
    assert (out[9:11, 2:] == -1).all()
    # Only rows inside the sample count towards its width.
    assert stitch_inline_masks([(turn0, 4), (turn1, 9)], 4).shape == (4, 0)
    assert stitch_inline_masks([(turn1, 0), (turn0, 4)], 4).shape == (4, 2)
