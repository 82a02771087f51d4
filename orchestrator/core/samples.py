"""From a rollout's turns to a trainable sample (pure): tokens, loss mask, logprobs, and
the payload stitched for the sample's span (docs/design.md §4, "From turns to samples").

Prefix caching across a group: members of a GRPO group share their prompt, so a server
that already ran one member's prompt serves the others' prompt rows from its prefix
cache and returns their routing only from `routed_experts_prompt_start`. A position's
routing depends only on the tokens up to it, so the rows a sibling returned for the shared
prompt *are* the rows the cached forward used: they fill the gap (`prompt_routing_donors`),
at lower priority than the rollout's own rows. The donor's file is then referenced by this
sample too, and the sink's reference counts keep it while either sample is queued.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import structlog

from orchestrator.core.rollouts import Sample
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import (
    BadSegment,
    FinalTokenRoute,
    PayloadSegment,
    clip_segment,
    encode_inline,
    stitch_inline_masks,
    stitch_inline_routing,
    stitch_masks,
    stitch_routing,
)

log = structlog.get_logger("orchestrator.samples")


@attrs.frozen
class RoutingDonor:
    """Routing rows of a sibling's shared prompt: a file segment or an inline array."""

    segment: PayloadSegment | None = None
    array: tuple[np.ndarray, int] | None = None


def prompt_routing_donors(first_turns: Sequence[TurnOutput], prompt_len: int) -> list[RoutingDonor]:
    """Prompt rows (positions below `prompt_len`) from the siblings' first turns: as few
    donors as cover what the siblings cover, earliest first.

    Only trusted turns give rows; rows past the shared prompt belong to the sibling's own
    completion and are clipped off. Any sibling's row at a position is as good as
    another's, so a donor whose rows lie within those already chosen is left out.
    """
    candidates: list[tuple[int, int, RoutingDonor]] = []
    for turn in first_turns:
        if turn.poisoned is not None:
            continue
        segment = turn.segments.get("routed_experts")
        if segment is not None and segment.pos < prompt_len:
            rows = min(segment.rows, prompt_len - segment.pos)
            donor = RoutingDonor(segment=clip_segment(segment, 0, rows, segment.pos))
            candidates.append((segment.pos, segment.pos + rows, donor))
        inline = turn.inline.get("routed_experts")
        if inline is not None and inline[1] < prompt_len:
            array, pos = inline
            clipped = array[: prompt_len - pos]
            candidates.append((pos, pos + len(clipped), RoutingDonor(array=(clipped, pos))))
    candidates.sort(key=lambda c: (c[0], -c[1]))
    donors: list[RoutingDonor] = []
    covered = 0
    for _, end, donor in candidates:
        if end > covered:
            donors.append(donor)
            covered = end
    return donors


def build_sample(
    rollout_id: str,
    token_ids: Sequence[int],
    turns: Sequence[tuple[int, TurnOutput]],
    *,
    payload_dir: Path | None,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
    routing_donors: Sequence[RoutingDonor] = (),
) -> tuple[Sample, bool]:
    """The sample of one trajectory branch, and whether its routing had to be dropped.

    `turns` pairs each turn's prompt length (the whole conversation before it) with what
    it returned; `token_ids` is the branch's whole sequence. Completion tokens are in the
    loss; prompt and environment tokens are not. A poisoned turn makes the sample
    untrainable. A routing gap keeps the tokens and drops the routing (returned True):
    the caller warns and counts. `routing_donors` fill positions no turn of this rollout
    covers (see the module docstring).
    """
    length = len(token_ids)
    loss_mask = [0] * length
    logprobs = [0.0] * length
    files: set[str] = set()
    poisoned: str | None = None
    for prompt_len, turn in turns:
        end = prompt_len + len(turn.completion_ids)
        loss_mask[prompt_len:end] = [1] * len(turn.completion_ids)
        logprobs[prompt_len:end] = turn.logprobs
        files |= turn.files
        poisoned = poisoned or turn.poisoned
    sample = Sample(
        rollout_id=rollout_id,
        token_ids=tuple(token_ids),
        loss_mask=tuple(loss_mask),
        logprobs=tuple(logprobs),
        payload_dir=str(payload_dir) if payload_dir is not None else None,
        files=frozenset(files),
        untrainable=f"poisoned: {poisoned}" if poisoned else None,
    )
    if poisoned or not fields or not turns:
        return sample, False
    outputs = [turn for _, turn in turns]
    try:
        if payload_dir is not None:
            donors = [d.segment for d in routing_donors if d.segment is not None]
            payload, dropped = _stitch_segments(outputs, donors, length, fields, final_token_route)
            # A borrowed row's file is referenced by this sample too.
            directory = str(payload_dir)
            used = {
                os.path.join(directory, s.file) for segs in payload.values() for s in segs if s.file
            }
            return attrs.evolve(sample, payload=payload, files=sample.files | used), dropped
        arrays = [d.array for d in routing_donors if d.array is not None]
        inline, dropped = _stitch_inline(outputs, arrays, length, fields, final_token_route)
        return attrs.evolve(sample, inline=inline), dropped
    except BadSegment as exc:
        # Turns of one branch that disagree on dtype or row shape: not trainable.
        return attrs.evolve(sample, untrainable=f"poisoned: {exc}"), False


def _stitch_segments(
    turns: Sequence[TurnOutput],
    donors: Sequence[PayloadSegment],
    length: int,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
) -> tuple[dict[str, tuple[PayloadSegment, ...]], bool]:
    payload: dict[str, tuple[PayloadSegment, ...]] = {}
    dropped = False
    if "routed_experts" in fields:
        routing = stitch_routing(
            [*(t.segments["routed_experts"] for t in turns), *donors], length, final_token_route
        )
        if routing is None:
            dropped = True
        else:
            payload["routed_experts"] = tuple(routing)
    if "sampling_mask" in fields:
        payload["sampling_mask"] = tuple(
            stitch_masks([t.segments["sampling_mask"] for t in turns], length)
        )
    return payload, dropped


def _stitch_inline(
    turns: Sequence[TurnOutput],
    donors: Sequence[tuple[np.ndarray, int]],
    length: int,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
) -> tuple[dict[str, dict[str, object]], bool]:
    inline: dict[str, dict[str, object]] = {}
    dropped = False
    if "routed_experts" in fields:
        routing = stitch_inline_routing(
            [*(t.inline["routed_experts"] for t in turns), *donors], length, final_token_route
        )
        if routing is None:
            dropped = True
        else:
            inline["routed_experts"] = encode_inline(routing, 0)
    if "sampling_mask" in fields:
        mask = stitch_inline_masks([t.inline["sampling_mask"] for t in turns], length)
        inline["sampling_mask"] = encode_inline(mask, 0)
    return inline, dropped
