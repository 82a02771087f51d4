"""A rollout while it runs (`RolloutRun`): what its turns so far hold, or why it failed.
Written by the runner (`rollout_runner.py`, `driven_rollouts.py`), read by the finisher
(`rollout_finisher.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np

from orchestrator.core.environments import DrivenEpisode, Episode
from orchestrator.core.turns import TurnOutput


@attrs.define
class RolloutRun:
    """A rollout while it runs: its turns so far, or why it failed (`failed`, and the
    failure's kind in `failure_kind`)."""

    rollout_id: str
    version: int
    payload_dir: Path | None
    tokens: np.ndarray  # int32: the prompt, then each turn's completion and env reply
    turns: list[tuple[int, TurnOutput]] = attrs.field(factory=list)
    failed: str | None = None
    failure_kind: str | None = None
    server: str = ""  # the inference server it ran on
    # Its conversation with the environment (the members of a group diverge).
    episode: Episode | DrivenEpisode | None = None
    # What an environment that drives its turns measured besides the reward.
    metrics: Mapping[str, float] = attrs.field(factory=dict)

    def fail(self, kind: str, detail: str) -> RolloutRun:
        self.failed, self.failure_kind = detail, kind
        return self
