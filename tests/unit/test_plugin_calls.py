"""A plugin environment's calls in worker threads: a call past its deadline gives back its
place at once, so calls that hang never starve the env; while too many still run, further
calls fail at once instead of piling up threads, and the env resumes as they return."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from orchestrator.core.environments import Sampling
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.tasks.plugin_env import LIVE_CALLS, MAX_LATE_CALLS, PluginBusy, PluginEnvironment

MODEL = Path(__file__).resolve().parents[2] / "demo" / "model"


def plugin_env(timeout_s: float) -> PluginEnvironment:
    return PluginEnvironment(
        name="game",
        plugin=None,
        tokenizer=ChatTokenizer.load(MODEL),
        sampling=Sampling(),
        rewards=(),
        pool=None,  # type: ignore[arg-type]  # no reward is scored here
        budget=1024,
        timeout_s=timeout_s,
    )


async def test_hung_calls_give_back_their_place_and_are_bounded() -> None:
    env = plugin_env(timeout_s=0.05)
    release = threading.Event()
    try:
        # More hung calls than the env runs at once: each times out on its own deadline,
        # none waits for a place behind the others.
        with trio.fail_after(5):
            for _ in range(LIVE_CALLS + 2):
                with pytest.raises(trio.TooSlowError):
                    await env.call(release.wait)
        assert await env.call(lambda: 7) == 7
        while True:
            try:
                with pytest.raises(trio.TooSlowError):
                    await env.call(release.wait)
            except PluginBusy as busy:
                assert f"{MAX_LATE_CALLS} or more calls still run" in str(busy)
                break
        # Refused without starting a thread.
        with pytest.raises(PluginBusy):
            await env.call(lambda: 7)
    finally:
        release.set()
    with trio.fail_after(5):
        while True:
            try:
                assert await env.call(lambda: 8) == 8
                break
            except PluginBusy:
                await trio.sleep(0.01)
