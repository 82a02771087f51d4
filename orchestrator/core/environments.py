"""The environment seam: where prompts, turns and rewards come from.

An environment is a small protocol the daemon is given (`run_daemon(environment=...)`):
it hands out the run's prompts by index, and starts an `Episode` for each rollout of a
prompt, which answers each completion with the tokens of the next turn's messages (or
ends the episode) and scores the finished trajectory. An episode holds what one rollout's
conversation needs between turns (the members of a group diverge after their first
completion). Prompts go by index so that a resumed run goes on with the prompt after the
last one it drew instead of replaying the run's first ones. The work is coroutines, so an
environment may do it off the event loop (tokenizing in a worker thread, rewards in
worker processes or on another machine) without the daemon knowing. Each prompt says how it is
sampled (`Sampling`: the request's sampling parameters and stop tokens) and how many
turns its episode may take at most.

An environment refuses a prompt it cannot use (a dataset row whose prompt does not fit
the sequence budget) with `PromptSkipped`, which the daemon counts and moves on from; a
score it cannot give (a reward function that raised, hung, or killed its worker) with
`ScoreFailed`, which discards the rollout as `reward_failed`. The simulator's toy
environments (`orchestrator.sim.environments`) and the real tasks
(`orchestrator.tasks`) are implementations.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from orchestrator.core.arrays import ARRAY_EQ, token_array

#: vLLM's sampling defaults the daemon sends unless an environment says otherwise.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_TOP_K = 50


@attrs.frozen
class Sampling:
    """How a prompt's turns are sampled: the generate request's `sampling_params`
    (`stop_token_ids`: the model's end-of-generation tokens; vLLM stops at its own eos
    too) and the most turns its episode may take."""

    max_tokens: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    temperature: float = attrs.field(default=DEFAULT_TEMPERATURE, validator=attrs.validators.ge(0))
    top_p: float = attrs.field(default=DEFAULT_TOP_P)
    top_k: int = attrs.field(default=DEFAULT_TOP_K)
    stop_token_ids: tuple[int, ...] = ()
    max_turns: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@attrs.frozen
class Prompt:
    """A task instance: what every task has, whatever the environment.

    `token_ids`: the first turn's prompt; `env`: the name of the environment it came from
    (it travels with every sample into the batch); `sampling`: how its turns are sampled;
    `info`: what the environment keeps about it to reply and score (a dataset row, an
    answer, the conversation so far, a hidden difficulty), opaque to the daemon.
    """

    prompt_id: str
    token_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    env: str = ""
    info: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    sampling: Sampling = Sampling()


class PromptSkipped(Exception):
    """`Environment.prompt` cannot use this index (e.g. a row longer than the budget):
    the daemon counts it under the environment's name and draws the next one."""

    def __init__(self, env: str, reason: str) -> None:
        super().__init__(f"{env}: {reason}")
        self.env = env
        self.reason = reason


class ScoreFailed(Exception):
    """`Environment.score` cannot score the trajectory: `kind` says why ("raised",
    "timeout", "worker_died", "bad_value"); the rollout is discarded as `reward_failed`."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Episode(Protocol):
    """One rollout's conversation with its environment, turn by turn."""

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> np.ndarray | None:
        """The tokens appended after a turn's completion, or None when the episode ends.

        `prompt_ids` is the turn's prompt (the whole conversation so far, as sent) and
        `completion_ids` what the server sampled: the next turn's prompt is both, then
        what this returns. A failure raises (the rollout is counted failed)."""
        ...

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        """The trajectory's reward, from every turn's completion. Raises `ScoreFailed`
        when it cannot be given."""
        ...


@attrs.frozen
class Driven:
    """How a driven episode ended (`DrivenEpisode.drive`): the environment's reward for
    it (None when it could not score it: `error` says why), its metrics, and every turn's
    sampled tokens as the environment recorded them, in order (the daemon checks them
    against the turns it ran). `error`: the episode itself failed (an exception in the
    environment, a dead worker, a stop condition that is an error); the rollout fails.
    `failed_calls`: the episode's model calls that failed on their way (a relay's 502: the
    daemon never saw them) or were answered 5xx, as (HTTP status, message); each is
    counted as a `model_call` failure, whether or not the rollout failed for it."""

    reward: float | None
    completions: tuple[tuple[int, ...], ...] = ()
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    error: str | None = None
    failed_calls: tuple[tuple[int, str], ...] = ()


@runtime_checkable
class DrivenEpisode(Protocol):
    """An episode whose environment drives its own turns (a verifiers environment): it
    calls the model itself, at `model_url`, the daemon's loopback endpoint for this one
    rollout, in the token-in/token-out form of prime-rl's and vLLM's
    `POST {model_url}/inference/v1/generate` (and `GET {model_url}/v1/models`). The daemon
    runs each call as a turn of its own (the policy version, the payload directory, the
    routing, retries, the in-flight limit), records it under the rollout, and answers with
    the tokens sampled. `score` then gives `Driven.reward` (raising `ScoreFailed` when it is
    None)."""

    async def drive(self, model_url: str) -> Driven:
        """Run the episode to its end. Never raises for the environment's own failures:
        they are `Driven.error`."""
        ...

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        """The reward `drive` reported. Raises `ScoreFailed` when there was none."""
        ...


@functools.cache
def drives_its_turns(episode_type: type) -> bool:
    """Whether episodes of `episode_type` are `DrivenEpisode`s, decided once per type: a
    runtime-checked protocol's isinstance walks the protocol's attributes every time
    (13 µs a rollout, docs/benchmarks.md § Where a real rollout's cost goes)."""
    return issubclass(episode_type, DrivenEpisode)


class Environment(Protocol):
    """What the daemon needs from an environment."""

    @property
    def name(self) -> str:
        """The environment's name, for logs."""
        ...

    async def prompt(self, index: int) -> Prompt:
        """The run's prompt number `index` (0, 1, ...): the same index always gives the
        same prompt, so a resumed run continues where the last one stopped. Raises
        `PromptSkipped` for an index it cannot use."""
        ...

    def episode(self, prompt: Prompt) -> Episode | DrivenEpisode:
        """A new episode of `prompt`, for one rollout (no I/O: it runs on the event loop):
        one the daemon drives turn by turn, or one that drives itself."""
        ...
