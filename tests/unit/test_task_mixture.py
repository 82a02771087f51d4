"""Several environments in one run: which one takes each prompt index is a pure function of
the index (a resumed run continues the very sequence), in proportion to the ratios, and
each environment sees its own positions 0, 1, 2, ... without a gap or a repeat."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import numpy as np
import pytest

from orchestrator.core.environments import Episode, Prompt
from orchestrator.tasks.mixture import BLOCK, EnvironmentMixture


@attrs.frozen
class RecordedEpisode:
    prompt: Prompt

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> None:
        return None

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        return float(self.prompt.info["position"])


@attrs.frozen
class Recorder:
    """An environment whose prompt says which position it was asked for."""

    name: str

    async def prompt(self, index: int) -> Prompt:
        return Prompt(f"{self.name}-{index}", [1], self.name, {"position": index})

    def episode(self, prompt: Prompt) -> Episode:
        return RecordedEpisode(prompt)


def mixture(seed: int = 3) -> EnvironmentMixture:
    return EnvironmentMixture([Recorder("a"), Recorder("b"), Recorder("c")], [3, 1, 0.5], seed)


def test_each_env_sees_its_positions_in_order_and_the_ratios_hold() -> None:
    mix = mixture()
    count = BLOCK + 5000  # across a block boundary
    choices = [mix.choice(i) for i in range(count)]
    by_env: dict[int, list[int]] = {}
    for env, position in choices:
        by_env.setdefault(env, []).append(position)
    for positions in by_env.values():
        assert positions == list(range(len(positions)))
    shares = Counter(env for env, _ in choices)
    assert abs(shares[0] / count - 3 / 4.5) < 0.01
    assert abs(shares[2] / count - 0.5 / 4.5) < 0.01


def test_the_choice_is_a_function_of_the_index_alone() -> None:
    # A fresh mixture asked for a late index first (a resumed run) agrees with one that
    # walked there, and another seed gives another sequence.
    walked = mixture()
    expected = [walked.choice(i) for i in range(3 * BLOCK + 10)]
    fresh = mixture()
    assert [fresh.choice(i) for i in range(3 * BLOCK, 3 * BLOCK + 10)] == expected[-10:]
    assert [mixture(seed=4).choice(i) for i in range(50)] != expected[:50]


async def test_episodes_are_the_env_s_the_prompt_came_from() -> None:
    mix = mixture()
    prompts = [await mix.prompt(i) for i in range(40)]
    for index, prompt in enumerate(prompts):
        env, position = mix.choice(index)
        assert prompt.env == "abc"[env] and prompt.info["position"] == position
        episode = mix.episode(prompt)
        assert await episode.score([]) == position
        assert await episode.reply(prompt.token_ids, np.array([], np.int32)) is None


def test_one_env_is_the_identity_and_bad_ratios_are_refused() -> None:
    single = EnvironmentMixture([Recorder("a")], [2.0])
    assert [single.choice(i) for i in range(5)] == [(0, i) for i in range(5)]
    with pytest.raises(ValueError, match="positive"):
        EnvironmentMixture([Recorder("a"), Recorder("b")], [1, 0])
    with pytest.raises(ValueError, match="one ratio per environment"):
        EnvironmentMixture([Recorder("a")], [1, 1])
