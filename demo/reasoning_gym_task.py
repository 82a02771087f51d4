"""A reasoning-gym task for `make demo-learn-real` (configs/learn-real.toml): its train
and held-out datasets, generated at a fixed seed, and its reward functions.

reasoning-gym (PyPI `reasoning-gym`, the `real-tasks` dependency group) generates
procedural tasks, each with its own scorer (`score_answer(answer, entry)`). The task is
`basic_arithmetic` with two one-digit terms and `+` ("Calculate 4 + 1."): SmolLM2-135M-
Instruct knows such sums but explains them at length instead of answering, so by the
task's own scoring it starts near 0.03 and has everything to gain from answering with
the number alone (docs/design.md §15 says why this task and what did not learn).

    python -m demo.reasoning_gym_task OUT_DIR   # writes OUT_DIR/train.jsonl, eval.jsonl

Rows are `{"question", "answer", "task", "entry"}` (`entry`: reasoning-gym's own entry,
as JSON, which its scorer takes). The held-out questions are ones the train set never
asks: the task has only about a hundred distinct questions, so they are split by
question, not by index.

The rewards, named in the config as "demo.reasoning_gym_task:task_score" and
"demo.reasoning_gym_task:just_a_number", run in the daemon's reward workers (the
project's venv, where the demo's stage installs the group).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TASK = "basic_arithmetic"
#: The task's generator settings: two one-digit terms, addition only, no negative
#: numbers, no parentheses.
SETTINGS: Mapping[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ("+",),
    "allow_negation": False,
    "allow_parentheses": False,
}
SEED = 54
#: Problems drawn to find the task's distinct questions (it has about 110).
DRAWN = 2000
#: Distinct questions held out for the eval; the train set is the others.
HELD_OUT = 48
#: Appended to each question: the instruction the model is asked to follow.
INSTRUCTION = " Answer with just the number."

_NUMBER = re.compile(r"[+-]?\d+(?:\.\d*)?")


def rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The train rows and the held-out rows, the same at every call (fixed seed)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(TASK, size=DRAWN, seed=SEED, **SETTINGS)
    by_question: dict[str, dict[str, Any]] = {}
    for entry in dataset:
        by_question.setdefault(entry["question"], entry)
    entries = list(by_question.values())
    held_out, train = entries[:HELD_OUT], entries[HELD_OUT:]

    def row(entry: dict[str, Any]) -> dict[str, Any]:
        entry = json.loads(json.dumps(entry))  # tuples as lists: as a reader sees it
        return {
            "question": entry["question"] + INSTRUCTION,
            "answer": entry["answer"],
            "task": TASK,
            "entry": entry,
        }

    return [row(entry) for entry in train], [row(entry) for entry in held_out]


def write_datasets(folder: Path) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` into `folder`; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "eval.jsonl"
    for path, lines in zip(paths, rows(), strict=True):
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return paths


@functools.cache
def _scorer(task: str) -> Callable[[str, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)  # type: ignore[return-value]


def task_score(completion: str, info: Mapping[str, Any]) -> float:
    """The task's own score of the completion (reasoning-gym's `score_answer`), the
    completion stripped of surrounding whitespace: 1 for the exact answer, the answer's
    share of the text when it holds the answer among other words, else 0."""
    return float(_scorer(str(info["task"]))(completion.strip(), info["entry"]))


def just_a_number(completion: str) -> float:
    """1 when the completion is a number and nothing else (right or wrong), else 0: the
    format the prompt asks for, which the task's scorer needs to give full marks."""
    return 1.0 if _NUMBER.fullmatch(completion.strip()) else 0.0


def main() -> int:
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m demo.reasoning_gym_task OUT_DIR\n")
        return 2
    train, held_out = write_datasets(Path(sys.argv[1]))
    rows_in = {path: len(path.read_text().splitlines()) for path in (train, held_out)}
    sys.stdout.write(", ".join(f"{path} ({n} rows)" for path, n in rows_in.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
