"""The environment seam: where prompts, turns and rewards come from.

An environment is a small protocol the daemon is given (`run_daemon(environment=...)`):
it hands out the run's prompts by index, answers each completion with the tokens of the
next turn's message (or ends the episode), and scores the finished trajectory. Prompts go
by index so that a resumed run goes on with the prompt after the last one it drew
instead of replaying the run's first ones; `reply` and `score` are coroutines, so an
environment may do its work off the event loop (in a worker thread or process, or on
another machine) without the daemon knowing. The simulator's toy environments
(`orchestrator.sim.environments`) are one implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from orchestrator.core.arrays import ARRAY_EQ, token_array


@attrs.frozen
class Prompt:
    """A task instance: what every task has, whatever the environment.

    `token_ids`: the first turn's prompt; `env`: the name of the environment it came from
    (for logs and for an environment made of several); `info`: what the environment keeps
    about it to reply and score (a dataset row, an answer, a hidden difficulty), opaque to
    the daemon.
    """

    prompt_id: str
    token_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    env: str = ""
    info: Mapping[str, Any] = attrs.field(factory=dict, hash=False)


class Environment(Protocol):
    """What the daemon needs from an environment."""

    @property
    def name(self) -> str:
        """The environment's name, for logs."""
        ...

    def prompt(self, index: int) -> Prompt:
        """The run's prompt number `index` (0, 1, ...): the same index always gives the
        same prompt, so a resumed run continues where the last one stopped. Must not
        block (it runs on the event loop)."""
        ...

    async def reply(
        self, prompt: Prompt, turn: int, completion_ids: np.ndarray
    ) -> np.ndarray | None:
        """The tokens appended after turn `turn`'s completion, or None when the episode
        ends."""
        ...

    async def score(self, prompt: Prompt, completions: Sequence[np.ndarray]) -> float:
        """The trajectory's reward, from every turn's completion."""
        ...
