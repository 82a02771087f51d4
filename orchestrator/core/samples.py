"""From a rollout's turns to a trainable sample (pure): tokens, loss mask, logprobs, and
the payload stitched for the sample's span (docs/design.md §4, "From turns to samples").

Each turn asked for routing rows from where the previous turn's rows ended (delta
replay), so a rollout's turns cover its positions between them; masks cover completion
tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from orchestrator.core.rollouts import Sample
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import (
    BadSegment,
    FinalTokenRoute,
    PayloadSegment,
    stitch_inline_masks,
    stitch_inline_routing,
    stitch_masks,
    stitch_routing,
)

log = structlog.get_logger(__name__)


def build_sample(
    rollout_id: str,
    token_ids: Sequence[int] | np.ndarray,
    turns: Sequence[tuple[int, TurnOutput]],
    *,
    payload_dir: Path | None,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
) -> tuple[Sample, bool]:
    """The sample of one trajectory branch, and whether its routing had to be dropped.

    `turns` pairs each turn's prompt length (the whole conversation before it) with what
    it returned; `token_ids` is the branch's whole sequence. Completion tokens are in the
    loss; prompt and environment tokens are not. A poisoned turn makes the sample
    untrainable. A routing gap keeps the tokens and drops the routing (returned True):
    the caller warns and counts.
    """
    length = len(token_ids)
    loss_mask = np.zeros(length, dtype=np.bool_)
    logprobs = np.zeros(length, dtype=np.float32)
    files: set[str] = set()
    poisoned: str | None = None
    for prompt_len, turn in turns:
        end = prompt_len + len(turn.completion_ids)
        loss_mask[prompt_len:end] = True
        logprobs[prompt_len:end] = turn.logprobs
        files |= turn.files
        poisoned = poisoned or turn.poisoned
    untrainable = f"poisoned: {poisoned}" if poisoned else None
    stitched: dict[str, Any] = {}
    dropped = False
    if not poisoned and fields and turns:
        outputs = [turn for _, turn in turns]
        try:
            if payload_dir is not None:
                stitched["payload"], dropped = _stitch_segments(
                    outputs, length, fields, final_token_route
                )
            else:
                stitched["inline"], dropped = _stitch_inline(
                    outputs, length, fields, final_token_route
                )
        except BadSegment as exc:
            # Turns of one branch that disagree on row shape: not trainable.
            untrainable = f"poisoned: {exc}"
    # Ours alone: frozen here, so the sample keeps them without a copy.
    loss_mask.flags.writeable = False
    logprobs.flags.writeable = False
    # Built once, with its payload (an `attrs.evolve` after would convert every field
    # again: this runs for every rollout on the event loop).
    sample = Sample(
        rollout_id=rollout_id,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        payload_dir=str(payload_dir) if payload_dir is not None else None,
        files=frozenset(files),
        untrainable=untrainable,
        **stitched,
    )
    return sample, dropped


def _stitch_segments(
    turns: Sequence[TurnOutput],
    length: int,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
) -> tuple[dict[str, tuple[PayloadSegment, ...]], bool]:
    payload: dict[str, tuple[PayloadSegment, ...]] = {}
    dropped = False
    if "routed_experts" in fields:
        routing = stitch_routing(
            [segment for t in turns for segment in _routing_segments(t)],
            length,
            final_token_route,
        )
        if routing is None:
            dropped = True
        else:
            payload["routed_experts"] = tuple(routing)
    if "sampling_mask" in fields:
        # A turn without a mask had no kept set for any token: its rows stay -1; a sample
        # none of whose positions has a mask row carries no mask at all (as inline).
        masks = [t.segments["sampling_mask"] for t in turns if "sampling_mask" in t.segments]
        stitched = tuple(stitch_masks(masks, length))
        if stitched:
            payload["sampling_mask"] = stitched
    return payload, dropped


def _routing_segments(turn: TurnOutput) -> list[PayloadSegment]:
    """A turn's routing segments in stitching order. Under disaggregated prefill/decode the
    prefill side's comes first: each position takes its row from the first segment that
    covers it, so the prefill's rows win where the sides overlap and the decode's supply
    the rest, the rule of the router's inline merge."""
    decode = turn.segments.get("routed_experts")
    return [segment for segment in (turn.prefill_routing, decode) if segment is not None]


def _stitch_inline(
    turns: Sequence[TurnOutput],
    length: int,
    fields: Sequence[str],
    final_token_route: FinalTokenRoute,
) -> tuple[dict[str, np.ndarray], bool]:
    inline: dict[str, np.ndarray] = {}
    dropped = False
    if "routed_experts" in fields:
        routing = stitch_inline_routing(
            [t.inline["routed_experts"] for t in turns], length, final_token_route
        )
        if routing is None:
            dropped = True
        else:
            inline["routed_experts"] = routing
    if "sampling_mask" in fields:
        masks = [t.inline["sampling_mask"] for t in turns if "sampling_mask" in t.inline]
        mask = stitch_inline_masks(masks, length)
        if mask.shape[1]:
            inline["sampling_mask"] = mask
    return inline, dropped
