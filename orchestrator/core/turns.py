"""One turn of a rollout as the daemon keeps it: what a generate reply said, checked."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from orchestrator.core.arrays import ARRAY_EQ, arrays_equal, float_array, token_array
from orchestrator.payload import PayloadSegment


def _inline_equal(a: Mapping[str, tuple[np.ndarray, int]], b: object) -> bool:
    if not isinstance(b, Mapping) or a.keys() != b.keys():
        return False
    return all(a[k][1] == b[k][1] and arrays_equal(a[k][0], b[k][0]) for k in a)


@attrs.frozen
class TurnOutput:
    """What one turn (one generate request, one choice) returned.

    `files` are absolute paths of payload files this turn wrote whose names passed
    validation: the only files the orchestrator will ever delete on its own. `poisoned`
    names why the payload cannot be trusted (a bad segment, `payload_error`); the tokens
    are still usable for the episode, but the rollout is never trained on. `segments`
    (by handle) and `inline` (field -> (array, position of its first row)) hold the
    payload fields the run trains with; a turn without a `sampling_mask` had no kept set
    for any of its tokens. `prefill_routing`, by handle under disaggregated
    prefill/decode, is the prefill side's routing segment (the prompt rows it computed);
    `segments["routed_experts"]` is then the decode side's, which supplies the positions
    after the prefill's rows end (docs/design.md §4).
    """

    completion_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    logprobs: np.ndarray = attrs.field(converter=float_array, eq=ARRAY_EQ, hash=False)
    finish_reason: str
    segments: Mapping[str, PayloadSegment] = attrs.field(factory=dict)
    inline: Mapping[str, tuple[np.ndarray, int]] = attrs.field(
        factory=dict, eq=attrs.cmp_using(eq=_inline_equal), hash=False
    )
    files: frozenset[str] = frozenset()
    poisoned: str | None = None
    prefill_routing: PayloadSegment | None = None
