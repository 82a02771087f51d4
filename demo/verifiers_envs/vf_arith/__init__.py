"""Single-turn arithmetic: "What is 17 + 25?", rewarded 1 when the reply's last number is
the answer, and 0.25 for a reply with a number at all (a shaping reward: it tells apart
the replies of a group even when none is right). A verifiers taskset (id `vf-arith`),
written with verifiers' own API."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

NUMBER = re.compile(r"-?\d+")


def questions(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` questions with their answers, the same ones for the same seed."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        made.append((f"What is {a} {op} {b}?", str(answer)))
    return made


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(trace.last_reply)
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.reward(weight=0.25)
    async def gives_a_number(self, trace: vf.Trace) -> float:
        return float(bool(NUMBER.search(trace.last_reply)))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithConfig(vf.TasksetConfig):
    count: int = 200
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        for question, answer in questions(self.config.count, self.config.seed):
            yield ArithTask(
                ArithData(
                    prompt=question,
                    system_prompt="Answer with a number.",
                    answer=answer,
                ),
                self.config.task,
            )
