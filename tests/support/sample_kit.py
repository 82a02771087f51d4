"""`TrainSample`s built for a test: without payload, with its payload by handle in real
payload files (written as a server writes them, stitched as the daemon stitches them), or
inline. On `sys.path` through pytest's `pythonpath` (pyproject.toml).

Every builder takes keyword overrides of any `TrainSample` field, so a suite names only
what its tests look at; the same arguments give the same sample (no randomness here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from orchestrator.core.rollouts import TrainSample
from orchestrator.payload import (
    FinalTokenRoute,
    PayloadSegment,
    stitch_inline_masks,
    stitch_inline_routing,
    stitch_masks,
    stitch_routing,
    write_payload_file,
)

Turn = Mapping[str, tuple[np.ndarray, int]]
"""One turn's payload as a server returns it: field -> (array, first position), the form
`write_payload_file` takes."""

_Part = TypeVar("_Part")
_Stitched = TypeVar("_Stitched")


def train_sample(
    length: int | None = None,
    *,
    prompt: int = 1,
    version: int = 0,
    logprob: float = -0.5,
    **fields: Any,
) -> TrainSample:
    """A sample of `length` tokens (that of `token_ids` when given, else 3), ids `1, 2, ...`:
    the first `prompt` positions are not trained on, the rest are; the logprob is 0 where
    the loss mask is off and `logprob` where it is on (the mask given, or the one from
    `prompt`). Group `g`, rollout `r`, start and dispatch `version`, reward 1, advantage
    0.5, no payload; `fields` replace any `TrainSample` field (`start_version` too)."""
    if length is None:
        length = len(fields["token_ids"]) if "token_ids" in fields else 3
    values: dict[str, Any] = {
        "group_id": "g",
        "rollout_id": "r",
        "start_version": version,
        "dispatch_version": version,
        "reward": 1.0,
        "advantage": 0.5,
        "token_ids": range(1, length + 1),
        "loss_mask": [0] * prompt + [1] * (length - prompt),
        **fields,
    }
    if "logprobs" not in values:
        values["logprobs"] = np.where(np.asarray(values["loss_mask"], dtype=bool), logprob, 0.0)
    return TrainSample(**values)


def stitched_payload(
    segments: Iterable[PayloadSegment], length: int, route: FinalTokenRoute = "repeat"
) -> dict[str, list[PayloadSegment]]:
    """The payload of a `length`-token sample from its turns' `segments` (in turn order),
    stitched per field as the daemon stitches them, for segments written once and shared
    by several samples. Fails when the turns leave a gap in the routing."""
    return _per_field(
        ((segment.field, segment) for segment in segments),
        lambda parts: stitch_routing(parts, length, route),
        lambda parts: stitch_masks(parts, length),
    )


def by_handle_sample(
    payload_dir: Path,
    turns: Sequence[Turn],
    length: int,
    *,
    route: FinalTokenRoute = "repeat",
    **fields: Any,
) -> TrainSample:
    """`train_sample(length, **fields)` whose payload is `turns`, each written into a new
    payload file of `payload_dir` (a version directory `<root>/v<k>`) as a server writes
    it, and stitched with `stitched_payload`."""
    segments = [segment for turn in turns for segment in write_payload_file(payload_dir, turn)]
    payload = stitched_payload(segments, length, route)
    return train_sample(length, payload_dir=str(payload_dir), payload=payload, **fields)


def inline_sample(
    turns: Sequence[Turn], length: int, *, route: FinalTokenRoute = "repeat", **fields: Any
) -> TrainSample:
    """`train_sample(length, **fields)` carrying `turns` inline, stitched per field as the
    daemon stitches an inline run's arrays: the same arrays a reader gets from the
    `by_handle_sample` of the same turns."""
    inline = _per_field(
        ((field, array) for turn in turns for field, array in turn.items()),
        lambda parts: stitch_inline_routing(parts, length, route),
        lambda parts: stitch_inline_masks(parts, length),
    )
    return train_sample(length, inline=inline, **fields)


def _per_field(
    parts: Iterable[tuple[str, _Part]],
    routing: Callable[[list[_Part]], _Stitched | None],
    masks: Callable[[list[_Part]], _Stitched],
) -> dict[str, _Stitched]:
    """Each field's `parts` (field, part: in turn order) stitched into the sample's: the
    routing by `routing`, the sampling masks by `masks`. One loop for both forms, so the
    by-handle and the inline sample of the same turns cannot drift apart."""
    by_field: dict[str, list[_Part]] = {}
    for field, part in parts:
        by_field.setdefault(field, []).append(part)
    stitched = {}
    for field, turn_parts in by_field.items():
        result = routing(turn_parts) if field == "routed_experts" else masks(turn_parts)
        assert result is not None, "the turns leave a gap in the routing"
        stitched[field] = result
    return stitched
