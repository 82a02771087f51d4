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
    are still usable for the episode, but the rollout is never trained on.
    """

    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    routing_pos: int
    segments: Mapping[str, PayloadSegment] = attrs.field(factory=dict)
    inline: Mapping[str, tuple[np.ndarray, int]] = attrs.field(factory=dict)
    files: frozenset[str] = frozenset()
    poisoned: str | None = None
