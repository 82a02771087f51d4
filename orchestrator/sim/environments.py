"""The simulator's toy environments: random token ids scored by a hash.

They exist for the demo, the tests and the benchmarks, and implement the daemon's
environment seam (`orchestrator.core.environments`): `reply` and `score` are each toy's
rules, which its episodes (`ToyEpisode`) follow turn by turn. Their rewards make some groups
all-equal (no signal) and some not, like real tasks of varying difficulty: each prompt
carries a hidden difficulty in `info`, the probability that a completion scores.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import numpy as np

from orchestrator.core.arrays import TOKEN_DTYPE
from orchestrator.core.environments import Environment, Episode, Prompt, Sampling

#: The toy environments, by the name `[env] name` gives.
TOY_ENVIRONMENTS = ("math", "chat", "mixed")


def _prompt_rng(seed: int, index: int) -> random.Random:
    """The generator of prompt `index` of a run seeded with `seed`: the same prompt for
    the same index in every run and after every resume."""
    return random.Random(f"{seed}/prompt/{index}")


def _score(prompt: Prompt, completion_ids: np.ndarray) -> float:
    """A deterministic score in {0, 0.5, 1}: a hash of the completion against the difficulty.

    Easy prompts (difficulty near 0) almost always score 1 and hard ones almost always 0,
    so their groups carry no signal; middling ones give mixed groups.
    """
    difficulty = float(prompt.info["difficulty"])
    h = 0
    for token in completion_ids.tolist():
        h = (h * 1_000_003 + token) % 2**61
    u = (h % 10_007) / 10_007
    if u >= difficulty:
        return 1.0
    if u >= difficulty * 0.8:
        return 0.5
    return 0.0


class _PromptShape(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def prompt_len_min(self) -> int: ...
    @property
    def prompt_len_max(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def _random_prompt(
    env: _PromptShape, rng: random.Random, difficulty: Callable[[], float], sampling: Sampling
) -> Prompt:
    """A prompt of `env`'s lengths and vocabulary, drawn from `rng`, with the hidden
    difficulty `difficulty()` draws (from the same `rng`, after the tokens). The token ids
    come from a numpy generator seeded by `rng`: a 4,000-token prompt in microseconds on
    the event loop instead of milliseconds."""
    length = rng.randint(env.prompt_len_min, env.prompt_len_max)
    generator = np.random.default_rng(rng.getrandbits(64))
    tokens = generator.integers(1, env.vocab_size, size=length, dtype=np.int32)
    info = {"difficulty": difficulty()}
    prompt_id = f"{env.name}-{rng.getrandbits(48):012x}"
    return Prompt(prompt_id, tokens, env.name, info, sampling)


class _ToyRules(Protocol):
    async def reply(
        self, prompt: Prompt, turn: int, completion_ids: np.ndarray
    ) -> np.ndarray | None: ...

    async def score(self, prompt: Prompt, completions: Sequence[np.ndarray]) -> float: ...


@attrs.define
class ToyEpisode:
    """One rollout of a toy prompt: the environment's rules, turn by turn."""

    rules: _ToyRules
    prompt: Prompt
    turn: int = 0

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> np.ndarray | None:
        answer = await self.rules.reply(self.prompt, self.turn, completion_ids)
        self.turn += 1
        return answer

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        return await self.rules.score(self.prompt, completions)


@attrs.frozen
class MathEnvironment:
    """Single turn: one prompt, one answer, a reward."""

    prompt_len_min: int
    prompt_len_max: int
    vocab_size: int
    seed: int = 0
    max_tokens: int = 256
    name: str = "math"

    async def prompt(self, index: int) -> Prompt:
        return self._draw(_prompt_rng(self.seed, index))

    def episode(self, prompt: Prompt) -> Episode:
        return ToyEpisode(self, prompt)

    def _draw(self, rng: random.Random) -> Prompt:
        # A third of prompts are trivial or impossible: their groups have no signal.
        sampling = Sampling(max_tokens=self.max_tokens)
        return _random_prompt(self, rng, lambda: rng.choice([0.0, 1.0, rng.random()]), sampling)

    async def reply(
        self, prompt: Prompt, turn: int, completion_ids: np.ndarray
    ) -> np.ndarray | None:
        return None

    async def score(self, prompt: Prompt, completions: Sequence[np.ndarray]) -> float:
        return _score(prompt, completions[-1])


@attrs.frozen
class ChatEnvironment:
    """Multi-turn: the user answers each completion, up to `max_turns` turns.

    The user's reply depends on the completion, so members of one group diverge after the
    first turn, and a later turn's prompt extends the previous turn's whole sequence (which
    is what lets an inference server's prefix cache skip the earlier rows).
    """

    prompt_len_min: int
    prompt_len_max: int
    vocab_size: int
    max_turns: int
    seed: int = 0
    max_tokens: int = 256
    name: str = "chat"

    async def prompt(self, index: int) -> Prompt:
        return self._draw(_prompt_rng(self.seed, index))

    def episode(self, prompt: Prompt) -> Episode:
        return ToyEpisode(self, prompt)

    def _draw(self, rng: random.Random) -> Prompt:
        sampling = Sampling(max_tokens=self.max_tokens, max_turns=self.max_turns)
        return _random_prompt(self, rng, rng.random, sampling)

    async def reply(
        self, prompt: Prompt, turn: int, completion_ids: np.ndarray
    ) -> np.ndarray | None:
        if turn + 1 >= self.max_turns or not len(completion_ids):
            return None
        seed = (int(completion_ids.sum(dtype=np.int64)) * 31 + turn) % self.vocab_size
        length = 8 + seed % 24
        steps = np.arange(length, dtype=np.int64)
        return (1 + (seed + 7 * steps) % (self.vocab_size - 1)).astype(TOKEN_DTYPE)

    async def score(self, prompt: Prompt, completions: Sequence[np.ndarray]) -> float:
        return sum(_score(prompt, c) for c in completions) / len(completions)


@attrs.frozen
class MixedEnvironment:
    """Draws from a single-turn and a multi-turn environment, half and half."""

    math: MathEnvironment
    chat: ChatEnvironment
    seed: int = 0
    name: str = "mixed"

    async def prompt(self, index: int) -> Prompt:
        rng = _prompt_rng(self.seed, index)
        if rng.random() < 0.5:
            return self.chat._draw(rng)
        return self.math._draw(rng)

    def episode(self, prompt: Prompt) -> Episode:
        rules = self.chat if prompt.env == self.chat.name else self.math
        return rules.episode(prompt)


def toy_environment(
    name: str,
    *,
    prompt_len_min: int,
    prompt_len_max: int,
    vocab_size: int,
    max_turns: int,
    max_tokens: int = 256,
    seed: int = 0,
) -> Environment:
    """The toy environment called `name` (one of `TOY_ENVIRONMENTS`): prompts of
    `prompt_len_min .. prompt_len_max` token ids below `vocab_size`, `max_tokens` per
    turn, up to `max_turns` turns in the multi-turn one. Raises ValueError for another
    name."""
    math = MathEnvironment(prompt_len_min, prompt_len_max, vocab_size, seed, max_tokens)
    chat = ChatEnvironment(prompt_len_min, prompt_len_max, vocab_size, max_turns, seed, max_tokens)
    environments: dict[str, Environment] = {
        "math": math,
        "chat": chat,
        "mixed": MixedEnvironment(math, chat, seed),
    }
    try:
        return environments[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r} (one of {TOY_ENVIRONMENTS})") from None
