"""An environment of real tasks over a dataset: each row a prompt, rendered with the
model's chat template, its completion decoded and scored by the user's reward functions in
worker processes (docs/design.md § Real tasks).

Rows are drawn in the env's `DataOrder` (shuffled with the run's seed, epoch by epoch), so
position `p` is always the same row. A row's prompt is its `messages` column, or a user
message from its `prompt` column after the optional system prompt. A prompt longer than
the budget (`batch.max_seq_len` minus the env's `max_tokens`) is skipped
(`PromptSkipped`) rather than sent to fail at the server; so is a row without a value in
a column the config names (its prompt, messages or answer): the skip names the env,
the column and the row. Reading a row, rendering it and
decoding a completion run in worker threads (the tokenizer releases the interpreter
lock), but for short completions, decoded on the loop (`decode_completions`); rewards run
in the reward pool's processes.

A row's render depends on the row alone (the tokenizer, template and system prompt are
the env's), so the env keeps its last renders (`RenderedRows`, `RENDERED_TOKENS` tokens in
all): a row drawn again (each eval's same rows, a small dataset's later epochs) costs no
read, render or worker thread. Prompts of the same row share its row and message objects,
which nothing changes (rewards get copies in their workers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NoReturn

import attrs
import numpy as np
import trio

from orchestrator.core.environments import (
    Episode,
    Prompt,
    PromptSkipped,
    Sampling,
)
from orchestrator.errors import UserError
from orchestrator.tasks.chat import ChatTokenizer, decode_completions
from orchestrator.tasks.datasets import DataOrder, Dataset
from orchestrator.tasks.reward_functions import RewardSpec
from orchestrator.tasks.reward_pool import RewardExecutor, score_episode

Message = dict[str, Any]


@attrs.frozen
class PromptColumns:
    """Which columns of a row make its prompt and its answer."""

    prompt: str | None = None  # the user message as text
    messages: str | None = None  # a chat message list
    system_prompt: str | None = None
    answer: str | None = None

    def check_answer(self, row: dict[str, Any]) -> None:
        """Raises ValueError when the answer column is configured and `row` has no value
        there (a JSON line without the key, a null): the row is skipped, never scored
        with an answer of None."""
        if self.answer is not None and row.get(self.answer) is None:
            raise ValueError(f"column {self.answer!r} has no value")

    def messages_of(self, row: dict[str, Any]) -> list[Message]:
        """The prompt's chat messages for `row`. Raises ValueError when the row's value
        is not what the column must hold."""
        if self.messages is not None:
            value = row.get(self.messages)
            if not isinstance(value, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
            ):
                raise ValueError(f"column {self.messages!r} is not a list of chat messages")
            messages = [dict(m) for m in value]
        else:
            assert self.prompt is not None
            text = row.get(self.prompt)
            if not isinstance(text, str):
                raise ValueError(f"column {self.prompt!r} is not text")
            messages = [{"role": "user", "content": text}]
        if self.system_prompt is not None and not (
            messages and messages[0].get("role") == "system"
        ):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages


#: The most prompt tokens an env keeps rendered: about 16 MB of ids, and as much again of
#: the rows' text and messages.
RENDERED_TOKENS = 4 * 2**20

#: A row read and rendered: the row, its prompt messages and their tokens (read-only).
Rendered = tuple[dict[str, Any], list[Message], np.ndarray]


@attrs.define(eq=False)
class RenderedRows:
    """The last rows rendered, by row index, at most `capacity` tokens in all: the least
    recently used go first. Used on the event loop only."""

    capacity: int = RENDERED_TOKENS
    _entries: OrderedDict[int, Rendered] = attrs.field(factory=OrderedDict, init=False)
    _tokens: int = attrs.field(default=0, init=False)

    def get(self, row_index: int) -> Rendered | None:
        rendered = self._entries.get(row_index)
        if rendered is not None:
            self._entries.move_to_end(row_index)
        return rendered

    def put(self, row_index: int, rendered: Rendered) -> None:
        """Keep `rendered` (unless it alone is over the capacity), dropping the least
        recently used rows past the capacity."""
        size = len(rendered[2])
        if size > self.capacity:
            return
        previous = self._entries.pop(row_index, None)
        if previous is not None:
            self._tokens -= len(previous[2])
        self._entries[row_index] = rendered
        self._tokens += size
        while self._tokens > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= len(dropped[2])

    @property
    def tokens(self) -> int:
        """The tokens of the rows kept."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)


class _RowUnusable(Exception):
    """A row that cannot be a prompt (its message says why): skipped and counted."""


@attrs.define(eq=False)
class DatasetEnvironment:
    """One `[[env]]` with a dataset; see the module docstring."""

    name: str
    dataset: Dataset
    order: DataOrder
    columns: PromptColumns
    tokenizer: ChatTokenizer
    rewards: tuple[RewardSpec, ...]
    pool: RewardExecutor
    sampling: Sampling
    # The most tokens a prompt may have.
    budget: int
    limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(2))
    rendered: RenderedRows = attrs.field(factory=RenderedRows)
    # Skips in a row: a whole epoch of them means no row fits (a fatal error, not a loop).
    _skips_in_a_row: int = 0

    async def prompt(self, index: int) -> Prompt:
        epoch, row_index = self.order.row_at(index)
        rendered = self.rendered.get(row_index)
        if rendered is None:
            try:
                rendered = await trio.to_thread.run_sync(
                    self._render, row_index, limiter=self.limiter
                )
            except _RowUnusable as unusable:
                self._skipped(row_index, str(unusable))
            self.rendered.put(row_index, rendered)
        row, messages, tokens = rendered
        self._skips_in_a_row = 0
        info = {
            "row": row,
            "prompt": messages,
            "answer": None if self.columns.answer is None else row.get(self.columns.answer),
            "row_index": row_index,
            "epoch": epoch,
        }
        return Prompt(f"{self.name}-e{epoch}-r{row_index}", tokens, self.name, info, self.sampling)

    def _render(self, row_index: int) -> Rendered:
        """The row, its prompt messages and their tokens. Raises `_RowUnusable` with why
        the row is skipped. Blocking."""
        row = self.dataset.row(row_index)
        try:
            messages = self.columns.messages_of(row)
            self.columns.check_answer(row)
        except ValueError as exc:
            raise _RowUnusable(f"row {row_index}: {exc}") from None
        tokens = self.tokenizer.render_prompt(messages)
        if len(tokens) > self.budget:
            raise _RowUnusable(
                f"row {row_index}: a prompt of {len(tokens)} tokens is over the budget of "
                f"{self.budget} (batch.max_seq_len - max_tokens)"
            )
        return row, messages, tokens

    def _skipped(self, row_index: int, reason: str) -> NoReturn:
        self._skips_in_a_row += 1
        if self._skips_in_a_row > len(self.dataset):
            raise UserError(
                f"env {self.name}: no row of {self.dataset.path} can be used ({reason})"
            )
        raise PromptSkipped(self.name, reason)

    def episode(self, prompt: Prompt) -> Episode:
        return DatasetEpisode(self, prompt)

    async def score(self, prompt: Prompt, completions: Sequence[np.ndarray]) -> float:
        """The rollout's reward: its completions decoded, the reward functions run on
        them in the reward pool. Raises `ScoreFailed`."""
        texts = await decode_completions(self.tokenizer, completions, self.limiter)
        info = prompt.info
        return await score_episode(
            self.pool,
            self.name,
            self.rewards,
            prompt=info["prompt"],
            messages=[*info["prompt"], *({"role": "assistant", "content": t} for t in texts)],
            completion=texts[-1],
            answer=info["answer"],
            info=info["row"],
        )


@attrs.frozen
class DatasetEpisode:
    """One rollout of a dataset row: a single turn, then the reward functions."""

    env: DatasetEnvironment
    prompt: Prompt

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> np.ndarray | None:
        return None

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        return await self.env.score(self.prompt, completions)
