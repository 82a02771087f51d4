"""One turn of a rollout as the daemon keeps it: what a generate reply said, checked."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from orchestrator.payload import PayloadSegment


@attrs.frozen
class TurnOutput:
    """What one turn (one generate request, one choice) returned.

    `files` are absolute paths of payload files this turn wrote whose names passed
    validation: the only files the orchestrator will ever delete on its own. `poisoned`
    names why the payload cannot be trusted (a bad segment, `payload_error`); the tokens
    are still usable for the episode, but the rollout is never trained on. `segments`
    (by handle) and `inline` (field -> (array, position of its first row)) hold the
    payload fields the run trains with; a turn without a `sampling_mask` had no kept set
    for any of its tokens.
    """

    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    segments: Mapping[str, PayloadSegment] = attrs.field(factory=dict)
    inline: Mapping[str, tuple[np.ndarray, int]] = attrs.field(factory=dict)
    files: frozenset[str] = frozenset()
    poisoned: str | None = None
