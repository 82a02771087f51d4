"""Reward functions for the reward pool's tests, imported by its worker processes.

`test_reward_pool.py` puts this folder on `sys.path` before it opens a pool, the way a user
puts the folder of their own reward module there; spawned workers inherit `sys.path`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def length(completion: str) -> float:
    return float(len(completion))


def answer_is_env(answer: str | None, env: str) -> float:
    return 1.0 if answer == env else 0.0


def numpy_half(completion: str) -> np.float32:
    return np.float32(0.5)


def trivial() -> float:
    return 1.0


def zero() -> float:
    return 0.0


def raises(completion: str) -> float:
    raise ValueError(f"cannot score {completion!r}")


def hangs() -> float:
    time.sleep(3600)
    return 1.0


def exits() -> float:
    os._exit(1)


def nan() -> float:
    return float("nan")


def string() -> str:
    return "1.0"


def naps() -> float:
    time.sleep(0.3)
    return 1.0


def no_daemon_modules(**kwargs: Any) -> float:
    """1.0 where the daemon's packages are not loaded, else raise naming them. (The
    `orchestrator` package's own `__init__` does load its handoff, payload, wire and core
    layers, and trio with them.)"""
    daemon = (
        "orchestrator.daemon",
        "orchestrator.commands",
        "orchestrator.sim",
        "orchestrator.config",
    )
    loaded = sorted(name for name in sys.modules if name.startswith(daemon))
    if loaded:
        raise RuntimeError(f"the worker imported {loaded}")
    return 1.0


def niceness() -> float:
    """The worker's own niceness."""
    return float(os.nice(0))


def pid() -> float:
    """The worker's process id."""
    return float(os.getpid())


_PREPARED_IN: list[int] = []


def prepared(**kwargs: Any) -> float:
    """1.0 where `prepared.prepare` already ran in this process before the first call,
    else raise."""
    if [os.getpid()] != _PREPARED_IN:
        raise RuntimeError(f"prepare ran in {_PREPARED_IN}, this worker is {os.getpid()}")
    return 1.0


prepared.prepare = lambda: _PREPARED_IN.append(os.getpid())  # type: ignore[attr-defined]


def announced() -> float:
    """1.0; its `prepare` writes a file named by the worker's pid into the folder
    `REWARD_FIXTURES_ANNOUNCE` names, when the worker starts."""
    return 1.0


def _announce() -> None:
    folder = os.environ.get("REWARD_FIXTURES_ANNOUNCE")
    if folder:
        (Path(folder) / str(os.getpid())).touch()


announced.prepare = _announce  # type: ignore[attr-defined]


def batch_size() -> float:
    """How many calls the worker's job held: the batch this call went out in."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "score_rollouts_captured":
            return float(len(frame.f_locals["calls"]))
        frame = frame.f_back
    raise RuntimeError("not called from a worker's job")


def keeps_a_thread() -> float:
    """1.0; its `prepare` starts a thread that never ends and is no daemon thread, as a
    library's background loop may: Python waits for it when the worker exits."""
    return 1.0


def _start_a_thread_that_never_ends() -> None:
    import threading

    threading.Thread(target=time.sleep, args=(3600,), name="library-loop").start()


keeps_a_thread.prepare = _start_a_thread_that_never_ends  # type: ignore[attr-defined]
