"""A dataset env keeps its last renders: a row drawn again is neither read nor rendered
again, within the token capacity, and gives the same prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from demo_run import DEMO_MODEL

from orchestrator.core.environments import PromptSkipped, Sampling
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.tasks.dataset_env import DatasetEnvironment, PromptColumns, RenderedRows
from orchestrator.tasks.datasets import DataOrder, open_dataset

ROWS = 6


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(DEMO_MODEL, require_chat_template=True)


@pytest.fixture
def environment(
    tmp_path: Path, tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DatasetEnvironment, list[int]]]:
    """An env over ROWS rows, the last one too long for the budget, and the row indices
    it rendered, in order."""
    path = tmp_path / "rows.jsonl"
    questions = [f"What is {i} + {i}?" for i in range(ROWS - 1)] + ["many words " * 200]
    path.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    dataset = open_dataset(path)
    env = DatasetEnvironment(
        name="sums",
        dataset=dataset,
        order=DataOrder(len(dataset), seed=0, key="sums"),
        columns=PromptColumns(prompt="question", system_prompt="Answer with a number."),
        tokenizer=tokenizer,
        rewards=(),
        pool=None,  # type: ignore[arg-type]  # prompts only: nothing is scored
        sampling=Sampling(),
        budget=100,
    )
    renders: list[int] = []
    render = DatasetEnvironment._render

    def counted(self: DatasetEnvironment, row_index: int) -> Any:
        renders.append(row_index)
        return render(self, row_index)

    monkeypatch.setattr(DatasetEnvironment, "_render", counted)
    yield env, renders
    dataset.close()


async def prompts(env: DatasetEnvironment, positions: range) -> dict[int, np.ndarray]:
    """The tokens of the prompts drawn at `positions`, by row index (skips left out)."""
    drawn: dict[int, np.ndarray] = {}
    for position in positions:
        try:
            prompt = await env.prompt(position)
        except PromptSkipped:
            continue
        drawn[int(prompt.info["row_index"])] = prompt.token_ids
    return drawn


async def test_a_row_drawn_again_is_not_rendered_again(
    environment: tuple[DatasetEnvironment, list[int]], tokenizer: ChatTokenizer
) -> None:
    env, renders = environment
    first = await prompts(env, range(ROWS))
    assert sorted(renders) == list(range(ROWS))  # every row once, the long one skipped
    assert len(first) == ROWS - 1 and len(env.rendered) == ROWS - 1
    renders.clear()
    second = await prompts(env, range(ROWS, 3 * ROWS))  # two more epochs
    # Only the skipped row is rendered again (skips are not kept), once an epoch.
    assert renders == [ROWS - 1, ROWS - 1]
    assert second.keys() == first.keys()
    for row_index, tokens in second.items():
        assert tokens.tolist() == first[row_index].tolist()
        expected = tokenizer.render_prompt(
            [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"What is {row_index} + {row_index}?"},
            ]
        )
        assert tokens.tolist() == expected.tolist()


async def test_past_the_capacity_the_least_recently_used_rows_go(
    environment: tuple[DatasetEnvironment, list[int]],
) -> None:
    env, renders = environment
    first = await prompts(env, range(ROWS))
    sizes = sorted(len(tokens) for tokens in first.values())
    env.rendered = RenderedRows(capacity=sum(sizes[-2:]))  # room for two prompts at least
    renders.clear()
    await prompts(env, range(ROWS, 2 * ROWS))
    kept = len(env.rendered)
    assert 2 <= kept < ROWS - 1 and env.rendered.tokens <= env.rendered.capacity
    renders.clear()
    again = await prompts(env, range(2 * ROWS, 3 * ROWS))
    # Each epoch is another shuffle: the rows kept from the last one are not rendered.
    assert len(renders) >= ROWS - kept
    assert again.keys() == first.keys()
    assert all(again[i].tolist() == first[i].tolist() for i in first)


def test_rendered_rows_keep_the_most_recently_used_within_the_capacity() -> None:
    rows = RenderedRows(capacity=10)

    def entry(size: int) -> Any:
        return ({}, [], np.zeros(size, dtype=np.int32))

    rows.put(1, entry(4))
    rows.put(2, entry(4))
    assert rows.get(1) is not None  # 1 is now the most recent
    rows.put(3, entry(4))  # 12 tokens: 2, the least recent, goes
    assert (rows.get(2), len(rows), rows.tokens) == (None, 2, 8)
    rows.put(3, entry(2))  # a row put again replaces its entry
    assert (len(rows), rows.tokens) == (2, 6)
    rows.put(4, entry(11))  # alone over the capacity: not kept, nothing dropped
    assert (rows.get(4), len(rows), rows.tokens) == (None, 2, 6)
