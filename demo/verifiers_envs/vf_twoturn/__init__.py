"""Arithmetic over two user turns: the question, then "check it and answer again"; the
reward is for the second answer. A verifiers taskset with an `Env` of its own (id
`vf-twoturn`), written with verifiers' own API.

`gives_a_number` is no reward of the task's: a shaping reward to plug in by verifiers' own
config, for a model that never answers right (a group whose rewards are all equal trains
nothing): `args = {taskset = {task = {rewards = {gives_a_number = {fn =
"vf_twoturn:gives_a_number", weight = 0.25}}}}}`."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["TwoTurnEnv", "TwoTurnTaskset", "gives_a_number"]

NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


async def gives_a_number(trace: vf.Trace) -> float:
    """1 for a last reply with a number at all (plugged in by config, see above)."""
    return float(last_number(trace.last_reply) is not None)


class TwoTurnData(vf.TaskData):
    answer: str


class TwoTurnTask(vf.Task[TwoTurnData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == self.data.answer)


class TwoTurnTasksetConfig(vf.TasksetConfig):
    count: int = 100
    seed: int = 1


class TwoTurnTaskset(vf.Taskset[TwoTurnTask, TwoTurnTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            yield TwoTurnTask(
                TwoTurnData(
                    prompt=f"What is {a} + {b}?",
                    system_prompt="Answer with a number.",
                    answer=str(a + b),
                ),
                self.config.task,
            )


class TwoTurnConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurnEnv(vf.Env[TwoTurnConfig]):
    """The task's question, then a second user turn asking to check the first answer."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            await chat.turn(
                f"You said {first.last_reply!r}. Check it and answer again, with the number only."
            )

    async def finalize(self, task, episode):
        for trace in episode.traces:
            replies = trace.assistant_messages
            first = (replies[0].content or "") if replies else ""
            trace.record_metric("first_correct", float(last_number(first) == task.data.answer))
