"""Environments: where prompts, turns and rewards come from.

An environment is a small protocol over token ids, so any task can plug in: it draws a
prompt, answers each completion with the tokens of the next turn's user message (or ends
the episode), and scores the finished trajectory. The built-in toy environments exist for
the demo and the tests; their rewards make some groups all-equal (no signal) and some not,
like real tasks of varying difficulty.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from orchestrator.core.arrays import ARRAY_EQ, token_array


@attrs.frozen
class Prompt:
    """A task instance: the first turn's prompt tokens and what the reward needs."""

    prompt_id: str
    token_ids: np.ndarray = attrs.field(converter=token_array, eq=ARRAY_EQ, hash=False)
    # Hidden per-prompt difficulty in [0, 1]: probability that a completion scores.
    difficulty: float


class Environment(Protocol):
    """What the dispatcher needs from an environment."""

    @property
    def name(self) -> str:
        """The environment's name, for logs."""
        ...

    def draw_prompt(self, rng: random.Random) -> Prompt:
        """A new prompt (deterministic given the RNG's state)."""
        ...

    def reply(
        self, prompt: Prompt, turn: int, completion_ids: Sequence[int]
    ) -> tuple[int, ...] | None:
        """The tokens appended after turn `turn`'s completion, or None when the episode ends."""
        ...

    def reward(self, prompt: Prompt, completions: Sequence[Sequence[int]]) -> float:
        """The trajectory's reward in [0, 1], from every turn's completion."""
        ...


def _score(prompt: Prompt, completion_ids: Sequence[int]) -> float:
    """A deterministic score in {0, 0.5, 1}: a hash of the completion against the difficulty.

    Easy prompts (difficulty near 0) almost always score 1 and hard ones almost always 0,
    so their groups carry no signal; middling ones give mixed groups.
    """
    h = 0
    for token in completion_ids:
        h = (h * 1_000_003 + token) % 2**61
    u = (h % 10_007) / 10_007
    if u >= prompt.difficulty:
        return 1.0
    if u >= prompt.difficulty * 0.8:
        return 0.5
    return 0.0


def _prompt_tokens(rng: random.Random, length: int, vocab_size: int) -> np.ndarray:
    """`length` token ids in ``1 .. vocab_size - 1``, drawn from a numpy generator seeded
    by `rng` (deterministic given its state): a 4,000-token prompt in microseconds on the
    event loop instead of milliseconds."""
    generator = np.random.default_rng(rng.getrandbits(64))
    return generator.integers(1, vocab_size, size=length, dtype=np.int32)


@attrs.frozen
class MathEnvironment:
    """Single turn: one prompt, one answer, a reward."""

    prompt_len_min: int
    prompt_len_max: int
    vocab_size: int
    name: str = "math"

    def draw_prompt(self, rng: random.Random) -> Prompt:
        length = rng.randint(self.prompt_len_min, self.prompt_len_max)
        tokens = _prompt_tokens(rng, length, self.vocab_size)
        # A third of prompts are trivial or impossible: their groups have no signal.
        difficulty = rng.choice([0.0, 1.0, rng.random()])
        return Prompt(f"{self.name}-{rng.getrandbits(48):012x}", tokens, difficulty)

    def reply(
        self, prompt: Prompt, turn: int, completion_ids: Sequence[int]
    ) -> tuple[int, ...] | None:
        return None

    def reward(self, prompt: Prompt, completions: Sequence[Sequence[int]]) -> float:
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
    name: str = "chat"

    def draw_prompt(self, rng: random.Random) -> Prompt:
        length = rng.randint(self.prompt_len_min, self.prompt_len_max)
        tokens = _prompt_tokens(rng, length, self.vocab_size)
        return Prompt(f"{self.name}-{rng.getrandbits(48):012x}", tokens, rng.random())

    def reply(
        self, prompt: Prompt, turn: int, completion_ids: Sequence[int]
    ) -> tuple[int, ...] | None:
        if turn + 1 >= self.max_turns or not completion_ids:
            return None
        seed = (sum(completion_ids) * 31 + turn) % self.vocab_size
        length = 8 + seed % 24
        return tuple(1 + (seed + 7 * i) % (self.vocab_size - 1) for i in range(length))

    def reward(self, prompt: Prompt, completions: Sequence[Sequence[int]]) -> float:
        return sum(_score(prompt, c) for c in completions) / len(completions)


@attrs.frozen
class MixedEnvironment:
    """Alternates between a single-turn and a multi-turn environment, prompt by prompt."""

    math: MathEnvironment
    chat: ChatEnvironment
    name: str = "mixed"

    def _pick(self, prompt: Prompt) -> Environment:
        return self.chat if prompt.prompt_id.startswith(self.chat.name) else self.math

    def draw_prompt(self, rng: random.Random) -> Prompt:
        env: Environment = self.chat if rng.random() < 0.5 else self.math
        return env.draw_prompt(rng)

    def reply(
        self, prompt: Prompt, turn: int, completion_ids: Sequence[int]
    ) -> tuple[int, ...] | None:
        return self._pick(prompt).reply(prompt, turn, completion_ids)

    def reward(self, prompt: Prompt, completions: Sequence[Sequence[int]]) -> float:
        return self._pick(prompt).reward(prompt, completions)


def make_environment(
    name: str, *, prompt_len_min: int, prompt_len_max: int, vocab_size: int, max_turns: int
) -> Environment:
    """The built-in environment called `name` ("math", "chat" or "mixed")."""
    math = MathEnvironment(prompt_len_min, prompt_len_max, vocab_size)
    chat = ChatEnvironment(prompt_len_min, prompt_len_max, vocab_size, max_turns)
    environments: dict[str, Environment] = {
        "math": math,
        "chat": chat,
        "mixed": MixedEnvironment(math, chat),
    }
    try:
        return environments[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}") from None
