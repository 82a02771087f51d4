"""Rewards on Ray against the local worker processes (docs/design.md §14): reward calls per
second, and the daemon's event-loop lag while slow rewards run.

Both executors have 2 slots (`[rewards] workers = 2`; the Ray side is a local instance
on this machine, so both use the same cores: the comparison is the executor's overhead
per call, not a cluster's extra cores). Three rewards: `math_answer` (math-verify on a
short completion), `burn` (about 20 ms of CPU) and `slow` (2 s of CPU, for the lag).
Calls are submitted all at once, 8 per slot, and the executor's back-pressure holds the
rest. The lag is how late a 5 ms sleep on the event loop wakes, measured every 5 ms while
the calls run.

Run: uv run --frozen --extra ray python bench/ray_rewards.py (skipped with a line where Ray
is not installed).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import git_revision, machine, write_section  # noqa: E402

from orchestrator.tasks.reward_functions import RewardSpec, load_reward  # noqa: E402
from orchestrator.tasks.reward_pool import open_reward_pool  # noqa: E402

SLOTS = 2
CALLS = {"math_answer": 400, "burn": 200, "slow": 4}
ARGUMENTS: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "What is 6 x 7?"}],
    "completion": "The answer is 42.",
    "messages": [],
    "answer": "42",
    "info": {},
    "env": "bench",
}


def specs() -> dict[str, list[RewardSpec]]:
    return {
        "math_answer": [load_reward("orchestrator.rewards:math_answer", 1.0)],
        "burn": [load_reward("_bench_rewards:burn", 1.0)],
        "slow": [load_reward("_bench_rewards:slow", 1.0)],
    }


async def measure(pool: Any, name: str, reward: list[RewardSpec]) -> dict[str, float]:
    """Calls per second and the loop's lag while `CALLS[name]` calls run."""
    lags: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = trio.current_time()
            await trio.sleep(0.005)
            lags.append(trio.current_time() - before - 0.005)

    async def call() -> None:
        await pool.score("bench", reward, ARGUMENTS)

    async with trio.open_nursery() as outer:
        outer.start_soon(ticker)
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(CALLS[name]):
                nursery.start_soon(call)
        elapsed = time.monotonic() - started
        done.set()
    lags.sort()
    return {
        "rate": CALLS[name] / elapsed,
        "elapsed": elapsed,
        "lag_p99": lags[int(0.99 * (len(lags) - 1))] * 1000,
        "lag_max": lags[-1] * 1000,
    }


async def run_executor(
    opener: Callable[[], AbstractAsyncContextManager[Any]],
) -> dict[str, dict[str, float]]:
    results = {}
    all_specs = specs()
    async with opener() as pool:
        for name, reward in all_specs.items():
            await pool.score("bench", reward, ARGUMENTS)  # warm
            results[name] = await measure(pool, name, reward)
            print(name, results[name], flush=True)
    return results


def main() -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray_rewards: skipped: Ray is not installed (uv sync --extra ray)")
        return 0
    from orchestrator.tasks.ray_rewards import open_ray_reward_pool

    preload = [s for group in specs().values() for s in group]
    processes = trio.run(run_executor, lambda: open_reward_pool(SLOTS, 60.0, preload=preload))
    on_ray = trio.run(run_executor, lambda: open_ray_reward_pool("", SLOTS, 60.0, preload=preload))
    rows = []
    for name in CALLS:
        p, r = processes[name], on_ray[name]
        rows.append(
            f"| `{name}` | {CALLS[name]} | {p['rate']:,.1f} | {r['rate']:,.1f} "
            f"| {p['lag_p99']:.1f} / {p['lag_max']:.1f} ms "
            f"| {r['lag_p99']:.1f} / {r['lag_max']:.1f} ms |"
        )
    markdown = "\n".join(
        [
            "## Rewards on Ray against the local worker processes",
            "",
            f"Machine: {machine()}. Commit {git_revision()}. {SLOTS} slots each; Ray is a local "
            "instance on the same cores (`bench/ray_rewards.py`).",
            "",
            "| reward | calls | processes: calls/s | Ray: calls/s "
            "| loop lag p99 / max, processes | loop lag p99 / max, Ray |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Ray costs a task submission and two streamed items per call (the reward's "
            "start, which its deadline counts from, then its outcome), fetched through a "
            "waiting thread: a few ms, which matters for rewards of a millisecond and not "
            "for the code runs and judges Ray is for. On a cluster its slots are the "
            "cluster's cores. The loop lag is the "
            "daemon's side: waiting on Ray happens in worker threads, so a slow remote "
            "reward costs the loop nothing but its thread's wake-up.",
        ]
    )
    write_section("ray-rewards", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
