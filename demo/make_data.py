"""Regenerate the demo's datasets: `python demo/make_data.py` (deterministic, seeded).

- `data/arith.jsonl`: 400 arithmetic word problems, `{"question": ..., "answer": ...}`,
  with +, - and the multiplication sign on small numbers (answers are never negative).
- `data/chat.jsonl`: 100 rows with a `messages` column (a system and a user message) and
  an `answer` column, for a second environment that starts from a conversation.
- `data/arith_eval.jsonl`: 64 held-out problems like `arith.jsonl`'s, none of its
  questions among them, for the demo's evals.

Running it again writes the same bytes; `tests/unit/test_task_chat.py` checks that the
committed files are what this script produces.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
ARITH_ROWS = 400
CHAT_ROWS = 100
EVAL_ROWS = 64
SEED = 20240611

TIMES = "\N{MULTIPLICATION SIGN}"
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")
_THINGS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards")

_SYSTEM_PROMPTS = (
    "You are a careful math tutor. Answer with the number only.",
    "You solve arithmetic problems. Reply with just the final number.",
    "Think step by step, then give the final answer as a single number.",
)


def _problem(rng: random.Random) -> tuple[str, int]:
    """One question and its answer: a bare sum, difference or product, or a short story."""
    op = rng.choice(("+", "-", TIMES))
    if op == TIMES:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        answer = a * b
    else:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if op == "-":
            a, b = max(a, b), min(a, b)
        answer = a + b if op == "+" else a - b
    if rng.random() < 0.5:
        return f"What is {a} {op} {b}?", answer
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    if op == "+":
        story = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
    elif op == "-":
        story = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
    else:
        story = f"{name} has {a} boxes with {b} {thing} in each. How many {thing} are there?"
    return story, answer


def arith_rows(rng: random.Random) -> Iterator[dict[str, object]]:
    for _ in range(ARITH_ROWS):
        question, answer = _problem(rng)
        yield {"question": question, "answer": str(answer)}


def chat_rows(rng: random.Random) -> Iterator[dict[str, object]]:
    for _ in range(CHAT_ROWS):
        question, answer = _problem(rng)
        messages = [
            {"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)},
            {"role": "user", "content": question},
        ]
        yield {"messages": messages, "answer": str(answer)}


def held_out_rows(rng: random.Random, seen: set[str]) -> Iterator[dict[str, object]]:
    """`EVAL_ROWS` problems whose questions are not in `seen`."""
    rows = 0
    while rows < EVAL_ROWS:
        question, answer = _problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows += 1
        yield {"question": question, "answer": str(answer)}


def render_jsonl(rows: Iterator[dict[str, object]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def datasets() -> dict[str, str]:
    """The file name and text of each dataset, from one seeded generator."""
    rng = random.Random(SEED)
    train = list(arith_rows(rng))
    chat = render_jsonl(chat_rows(rng))
    held_out = render_jsonl(held_out_rows(rng, {str(row["question"]) for row in train}))
    return {
        "arith.jsonl": render_jsonl(iter(train)),
        "chat.jsonl": chat,
        "arith_eval.jsonl": held_out,
    }


def main() -> None:
    DATA_DIR.mkdir(exist_ok=True)
    for name, text in datasets().items():
        (DATA_DIR / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
