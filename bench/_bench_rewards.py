"""Reward functions for bench/ray_rewards.py, imported by its worker processes and Ray
tasks (this folder is on their path)."""

from __future__ import annotations

import time


def burn(completion: str) -> float:
    """About 20 ms of CPU: a reward that computes (a small program run, a parse)."""
    deadline = time.process_time() + 0.02
    total = 0
    while time.process_time() < deadline:
        total += sum(range(200))
    return float(len(completion) % 2)


def slow(completion: str) -> float:
    """Two seconds of CPU: a reward that runs a test suite."""
    deadline = time.process_time() + 2.0
    while time.process_time() < deadline:
        sum(range(200))
    return 1.0
