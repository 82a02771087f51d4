"""Several environments in one run: each prompt index goes to one of them, by their
`ratio`s, and each environment sees its own positions 0, 1, 2, ... (docs/design.md § Real
tasks).

Which environment takes prompt `i` is drawn from a generator seeded by the run's seed and
the block `i` falls in (a block is `BLOCK` indices), so the choice is a pure function of
`i`: a resumed run that knows how many prompts it drew continues the very sequence, and
every environment continues its own data order where it stopped. An environment's
position for index `i` is how many of the indices before `i` went to it, counted block by
block (`np.bincount` over a block of choices: milliseconds per million prompts) and kept
for the blocks already seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from orchestrator.core.environments import DrivenEpisode, Environment, Episode, Prompt

#: Prompt indices per block of environment choices.
BLOCK = 1 << 16


@attrs.define(eq=False)
class EnvironmentMixture:
    """`environments` drawn from in proportion to `ratios` (positive numbers)."""

    environments: Sequence[Environment]
    ratios: Sequence[float]
    seed: int = 0
    name: str = "mixture"
    _probabilities: np.ndarray = attrs.field(init=False)
    # Counts per environment before each block seen so far (row b: before block b).
    _counts_before: list[np.ndarray] = attrs.field(init=False, factory=list)
    _block: tuple[int, np.ndarray] | None = attrs.field(init=False, default=None)
    _by_name: dict[str, Environment] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if not self.environments or len(self.environments) != len(self.ratios):
            raise ValueError("one ratio per environment, at least one environment")
        ratios = np.asarray(self.ratios, dtype=np.float64)
        if not (np.isfinite(ratios).all() and (ratios > 0).all()):
            raise ValueError(f"ratios must be positive numbers, got {list(self.ratios)}")
        self._probabilities = ratios / ratios.sum()
        self._by_name = {environment.name: environment for environment in self.environments}
        if len(self._by_name) != len(self.environments):
            raise ValueError("every environment of a mixture needs its own name")
        self._counts_before.append(np.zeros(len(self.environments), dtype=np.int64))

    def choice(self, index: int) -> tuple[int, int]:
        """The environment prompt `index` goes to, and its position in that environment."""
        if index < 0:
            raise ValueError(f"prompt index must not be negative, got {index}")
        if len(self.environments) == 1:
            return 0, index
        block, offset = divmod(index, BLOCK)
        choices = self._choices(block)
        env = int(choices[offset])
        earlier = int(np.count_nonzero(choices[:offset] == env))
        return env, int(self._counts_before[block][env]) + earlier

    def _choices(self, block: int) -> np.ndarray:
        if self._block is not None and self._block[0] == block:
            return self._block[1]
        # Counts before every block up to this one (each block's choices drawn once).
        while len(self._counts_before) <= block:
            done = len(self._counts_before) - 1
            counts = np.bincount(self._draw(done), minlength=len(self.environments))
            self._counts_before.append(self._counts_before[done] + counts)
        choices = self._draw(block)
        self._block = (block, choices)
        return choices

    def _draw(self, block: int) -> np.ndarray:
        generator = np.random.default_rng([abs(self.seed), int(self.seed < 0), block])
        return generator.choice(len(self.environments), size=BLOCK, p=self._probabilities)

    async def prompt(self, index: int) -> Prompt:
        env, position = self.choice(index)
        return await self.environments[env].prompt(position)

    def episode(self, prompt: Prompt) -> Episode | DrivenEpisode:
        """An episode of the environment `prompt` came from."""
        try:
            environment = self._by_name[prompt.env]
        except KeyError:
            raise ValueError(f"no environment named {prompt.env!r} in this mixture") from None
        return environment.episode(prompt)
