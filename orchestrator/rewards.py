"""The built-in reward functions, named in a config as `orchestrator.rewards:<name>`.

Each takes the keyword arguments it needs (`completion`, the final completion's text, and
`answer`, the dataset's answer column value or None) and returns 1.0 or 0.0. A leaf
module: the reward pool's workers import it, so it imports nothing of the daemon.

math-verify (with sympy) takes about half a second to import, so it is imported on first
use: the daemon checks that `math_answer` exists without paying for it, and each worker
imports it when it starts, through `math_answer.prepare` (see
`orchestrator.tasks.reward_functions.import_reward_functions`).
"""

from __future__ import annotations

import functools
import re
import threading
from types import ModuleType

# math-verify bounds each parse and each comparison with signal.alarm(seconds), which only
# works in a process's main thread: elsewhere it raises ValueError instead of parsing.
# A reward pool worker runs its jobs in its main thread, so there the alarm turns a
# pathological expression into a 0.0 in whole seconds; in any other thread the timeouts
# are off (None), and the pool's per-call deadline, which kills the worker, is the bound.
_MATH_VERIFY_TIMEOUT_S = 3


@functools.cache
def _math_verify() -> ModuleType:
    import math_verify
    import math_verify.errors

    module: ModuleType = math_verify
    return module


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)", re.ASCII)


def exact_match(completion: str, answer: object) -> float:
    """1.0 when the completion, stripped, equals the answer, stripped, as strings; else
    0.0 (also when there is no answer)."""
    if answer is None:
        return 0.0
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def math_answer(completion: str, answer: object) -> float:
    """1.0 when the completion's final answer equals the dataset's answer as mathematics
    (math-verify: `\\frac{1}{2}` equals `0.5`), else 0.0.

    The completion's answer is what math-verify's default extraction finds: the last
    `\\boxed{}`, else the last LaTeX or plain expression (such as the last number). No
    answer, text that does not parse, or a parse or comparison that runs out of time
    gives 0.0, never an exception.
    """
    if answer is None:
        return 0.0
    math_verify = _math_verify()
    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout_s = _MATH_VERIFY_TIMEOUT_S if in_main_thread else None
    try:
        gold = math_verify.parse(str(answer), parsing_timeout=timeout_s)
        if not gold:
            return 0.0
        target = math_verify.parse(completion, parsing_timeout=timeout_s)
        if not target:
            return 0.0
        matched = math_verify.verify(gold, target, timeout_seconds=timeout_s)
    # TimeoutException is a BaseException; math-verify catches its own, but an alarm
    # that fires between its handlers must still give 0.0.
    except (Exception, math_verify.errors.TimeoutException):
        return 0.0
    return 1.0 if matched else 0.0


# What a reward worker runs when it starts (its heavy import), before its first call.
math_answer.prepare = _math_verify  # type: ignore[attr-defined]


def number_format(completion: str) -> float:
    """1.0 when the completion, stripped, is a single integer or decimal number (such as
    `42`, `-3`, `0.25`), else 0.0."""
    return 1.0 if _NUMBER.fullmatch(completion.strip()) else 0.0
