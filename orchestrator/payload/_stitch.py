"""Stitch a sample's payload from its branch's turns (pure: no files are read).

A branch has turns. Turn ``t``'s routing rows cover positions ``pos_t ..`` (``pos_t`` > 0
when the turn asked only for the rows the earlier turns did not return) up to the
second-to-last token it handled; its mask rows cover its completion tokens. A sample is
the branch's first ``L`` tokens.

**Routing.** Each position takes its row from the *first* turn that covers it (that
forward pass sampled the token); the rows must cover positions ``0 .. L-2`` with no gap.
The final token, which no forward pass ran, gets one more row: a copy of row ``L-2``
(``"repeat"``, what the inline path does) or ``-1`` everywhere (``"sentinel"``: the
trainer's router picks). ``-1`` does not fit the unsigned routing dtypes, so a sentinel
widens the sample's array (``uint8 -> int16``, ``uint16 -> int32``); the reader does the
same, so both paths give the same array.

**Masks.** Each turn's mask rows inside ``0 .. L-1`` are kept (the first turn wins should
two overlap). The sample's mask is ``int32 [L, W]``, ``W`` the widest kept segment, ``-1``
for positions without a mask row (prompt tokens) and for padding.

**Digests after clipping.** A clipped segment covers only part of the bytes its parent
was digested over, so it carries the parent's ``digest`` together with the parent's byte
range (``digest_offset``, ``digest_nbytes``). A verified read hashes that whole range once
and slices the rows out of it: what is verified is always the bytes the writer digested.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np

from ._errors import BadSegment
from ._segment import PayloadSegment

FinalTokenRoute = Literal["repeat", "sentinel"]

#: The value of a sentinel row: "no recorded route, let the trainer's router pick".
SENTINEL = -1


@attrs.frozen
class Clip:
    """Rows ``first_row .. first_row + rows - 1`` of turn `turn`, at positions ``pos ..``."""

    turn: int
    first_row: int
    rows: int
    pos: int


def plan_routing(spans: Sequence[tuple[int, int]], sample_len: int) -> list[Clip] | None:
    """Plan which turn's rows give each position ``0 .. sample_len - 2``.

    `spans` holds each turn's ``(pos, rows)`` in turn order. Each position is taken from
    the first turn covering it. Returns the clips sorted by position, or None when some
    position in ``0 .. sample_len - 2`` is covered by no turn.

    Raises `ValueError` for ``sample_len < 1`` or a negative pos or row count.
    """
    if sample_len < 1:
        raise ValueError(f"sample_len must be at least 1, got {sample_len}")
    clips, uncovered = _assign(spans, sample_len - 1)
    return None if uncovered else clips


def stitch_routing(
    turn_segments: Sequence[PayloadSegment],
    sample_len: int,
    final_token_route: FinalTokenRoute,
) -> list[PayloadSegment] | None:
    """Turn each turn's ``routed_experts`` segment into the sample's segments.

    The result covers positions ``0 .. sample_len - 1`` in order: clipped segments (see
    the module docstring for their digests) and one final-token row, a 1-row segment
    pointing at the bytes of row ``sample_len - 2`` (``"repeat"``) or a fill segment of
    ``-1`` (``"sentinel"``). Returns None when the turns leave a gap in ``0 ..
    sample_len - 2``, when ``"repeat"`` has no row to copy (a one-token sample) and when
    ``"sentinel"`` has no turn to take the row shape from; the caller keeps the tokens
    and drops the routing.

    Raises `BadSegment` when the turns disagree on row shape and `ValueError`
    for a segment of another field or a bad `sample_len`.
    """
    for segment in turn_segments:
        if segment.field != "routed_experts":
            raise ValueError(f"stitch_routing takes routed_experts, got {segment.field}")
    _check_consistent([(s.file, s.shape[1:]) for s in turn_segments])
    plan = plan_routing([(s.pos, s.rows) for s in turn_segments], sample_len)
    if plan is None:
        return None
    stitched = [clip_segment(turn_segments[c.turn], c.first_row, c.rows, c.pos) for c in plan]
    if final_token_route == "repeat":
        if not stitched:
            return None
        last = stitched[-1]
        stitched.append(clip_segment(last, last.rows - 1, 1, sample_len - 1))
    else:
        if not turn_segments:
            return None
        template = turn_segments[0]
        stitched.append(
            PayloadSegment(
                field="routed_experts",
                file="",
                offset=0,
                pos=sample_len - 1,
                shape=(1, *template.shape[1:]),
                dtype=template.dtype,
                fill=SENTINEL,
            )
        )
    return stitched


def stitch_inline_routing(
    turn_arrays: Sequence[tuple[np.ndarray, int]],
    sample_len: int,
    final_token_route: FinalTokenRoute,
) -> np.ndarray | None:
    """The inline twin of `stitch_routing`: each turn's ``(array, pos)`` -> ``[L, layers,
    top_k]``.

    With ``"sentinel"`` the array is widened so ``-1`` fits (``uint8 -> int16``,
    ``uint16 -> int32``). Returns None exactly when `stitch_routing` would.
    Raises like `stitch_routing`.
    """
    _check_consistent([("", a.shape[1:]) for a, _ in turn_arrays])
    plan = plan_routing([(pos, a.shape[0]) for a, pos in turn_arrays], sample_len)
    if plan is None or not turn_arrays:
        return None
    if final_token_route == "repeat" and not plan:
        return None
    template = turn_arrays[0][0]
    # A server picks the routing dtype per reply (uint8 while every id fits): promote.
    dtype = np.result_type(*(array.dtype for array, _ in turn_arrays))
    if final_token_route == "sentinel":
        dtype = sentinel_dtype(dtype)
    out = np.empty((sample_len, *template.shape[1:]), dtype=dtype)
    for clip in plan:
        array = turn_arrays[clip.turn][0]
        out[clip.pos : clip.pos + clip.rows] = array[clip.first_row : clip.first_row + clip.rows]
    if final_token_route == "repeat":
        out[sample_len - 1] = out[sample_len - 2]
    else:
        out[sample_len - 1] = SENTINEL
    return out


def stitch_masks(turn_segments: Sequence[PayloadSegment], sample_len: int) -> list[PayloadSegment]:
    """Keep each turn's ``sampling_mask`` rows that fall inside ``0 .. sample_len - 1``.

    Rows past the sample are clipped off; a position two turns cover keeps the first
    turn's row; segments left with no rows are dropped. The result is sorted by position.
    Raises `ValueError` for a segment of another field or a bad `sample_len`.
    """
    for segment in turn_segments:
        if segment.field != "sampling_mask":
            raise ValueError(f"stitch_masks takes sampling_mask, got {segment.field}")
    if sample_len < 1:
        raise ValueError(f"sample_len must be at least 1, got {sample_len}")
    clips, _ = _assign([(s.pos, s.rows) for s in turn_segments], sample_len)
    return [clip_segment(turn_segments[c.turn], c.first_row, c.rows, c.pos) for c in clips]


def stitch_inline_masks(
    turn_arrays: Sequence[tuple[np.ndarray, int]], sample_len: int
) -> np.ndarray:
    """The inline twin of `stitch_masks` plus the reader: the sample's ``int32 [L, W]`` mask.

    ``W`` is the widest kept turn's width (0 when no turn has a row inside the sample);
    positions without a mask row and padding are ``-1``.
    Raises `ValueError` for a bad `sample_len`.
    """
    if sample_len < 1:
        raise ValueError(f"sample_len must be at least 1, got {sample_len}")
    clips, _ = _assign([(pos, a.shape[0]) for a, pos in turn_arrays], sample_len)
    width = max((turn_arrays[c.turn][0].shape[1] for c in clips), default=0)
    out = np.full((sample_len, width), -1, dtype=np.int32)
    for clip in clips:
        array = turn_arrays[clip.turn][0]
        rows = array[clip.first_row : clip.first_row + clip.rows]
        out[clip.pos : clip.pos + clip.rows, : array.shape[1]] = rows
    return out


def sentinel_dtype(dtype: np.dtype[np.generic]) -> np.dtype[np.generic]:
    """The narrowest dtype holding both `dtype`'s values and the ``-1`` sentinel."""
    return np.promote_types(dtype, np.min_scalar_type(SENTINEL))


def _assign(spans: Sequence[tuple[int, int]], end: int) -> tuple[list[Clip], list[tuple[int, int]]]:
    """Give each position ``0 .. end - 1`` to the first span covering it.

    Returns the clips sorted by position and the half-open intervals no span covers.
    """
    uncovered = [(0, end)] if end > 0 else []
    clips: list[Clip] = []
    for turn, (pos, rows) in enumerate(spans):
        if pos < 0 or rows < 0:
            raise ValueError(f"turn {turn}: negative pos {pos} or rows {rows}")
        still_uncovered: list[tuple[int, int]] = []
        for start, stop in uncovered:
            lo, hi = max(start, pos), min(stop, pos + rows)
            if lo >= hi:
                still_uncovered.append((start, stop))
                continue
            clips.append(Clip(turn=turn, first_row=lo - pos, rows=hi - lo, pos=lo))
            if start < lo:
                still_uncovered.append((start, lo))
            if hi < stop:
                still_uncovered.append((hi, stop))
        uncovered = still_uncovered
    clips.sort(key=lambda clip: clip.pos)
    return clips, uncovered


def clip_segment(segment: PayloadSegment, first_row: int, rows: int, pos: int) -> PayloadSegment:
    """Rows ``first_row ..`` of `segment`, placed at position `pos`, keeping its digest."""
    if first_row == 0 and rows == segment.rows and pos == segment.pos:
        return segment
    shape = (rows, *segment.shape[1:])
    if segment.is_fill:
        return attrs.evolve(segment, pos=pos, shape=shape)
    offset = segment.offset + first_row * segment.row_nbytes
    if segment.digest is None:
        return attrs.evolve(segment, offset=offset, pos=pos, shape=shape)
    digest_offset, digest_nbytes = segment.digest_range
    return attrs.evolve(
        segment,
        offset=offset,
        pos=pos,
        shape=shape,
        digest_offset=digest_offset,
        digest_nbytes=digest_nbytes,
    )


def _check_consistent(turns: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """All turns of one branch come from one model: the same row shape (their dtypes may
    differ, and are promoted to the widest)."""
    if not turns:
        return
    _, row_shape = turns[0]
    for file, other_row_shape in turns[1:]:
        if other_row_shape != row_shape:
            raise BadSegment(
                "shape", file, f"row shape {list(other_row_shape)} differs from {list(row_shape)}"
            )
