"""Reward functions for bench/verifiers_cost.py's dataset env: the rewards of the demo's
verifiers taskset `vf-arith` (demo/verifiers_envs/vf_arith) as reward functions of a
dataset env, so both score the same task the same way. Its `@vf.reward`s read
`trace.last_reply` (the reply's text, stripped); these read the decoded completion. The
weights (1.0 and 0.25, as the taskset's) are the env's `reward_weights`. Imported by the
reward worker processes (this folder is on their path)."""

from __future__ import annotations

import re

#: vf_arith's NUMBER.
NUMBER = re.compile(r"-?\d+")


def correct(completion: str, answer: str | None) -> float:
    """1 when the reply's last number is the answer (vf_arith's `correct`)."""
    numbers = NUMBER.findall(completion.strip())
    return float(bool(numbers) and numbers[-1] == answer)


def gives_a_number(completion: str) -> float:
    """1 for a reply with a number at all (vf_arith's `gives_a_number`)."""
    return float(bool(NUMBER.search(completion.strip())))


#: The env's reward functions and their weights (vf_arith's `@vf.reward(weight=...)`).
REWARDS = {"_arith_rewards:correct": 1.0, "_arith_rewards:gives_a_number": 0.25}
