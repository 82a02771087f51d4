"""Rewards on a Ray cluster (`[rewards] executor = "ray"`), on a local Ray instance: the
same reward functions and failure kinds as the local worker processes, the timeout,
back-pressure at the cluster's capacity, and a whole run of the demo scoring on Ray
with a reward that fails remotely.

Runs only in `make test-extras` (tests/extras/run.sh), which installs the extras and sets
`ORCH_TEST_EXTRAS`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from demo_run import DEMO_CONFIG, DEMO_DATA, demo_paths

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.handoff import shipped_steps
from orchestrator.tasks.ray_rewards import open_ray_reward_pool
from orchestrator.tasks.reward_functions import RewardSpec, load_reward
from orchestrator.tasks.reward_pool import RewardFailed

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "integration"

ARGUMENTS: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "Name a capital."}],
    "completion": "Paris",
    "messages": [
        {"role": "user", "content": "Name a capital."},
        {"role": "assistant", "content": "Paris"},
    ],
    "answer": "capitals",
    "info": {"answer": "capitals"},
    "env": "capitals",
}


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the instance starts: a local instance's workers get the daemon's sys.path.
    monkeypatch.syspath_prepend(str(FIXTURES))


def fixture(name: str, weight: float = 1.0) -> RewardSpec:
    return load_reward(f"reward_fixtures:{name}", weight)


async def test_rewards_and_each_failure_kind_on_a_local_ray_instance() -> None:
    specs = [fixture("length", 0.5), fixture("answer_is_env", 2.0)]
    failing = {
        "raised": [fixture("raises")],
        "timeout": [fixture("hangs")],
        "worker_died": [fixture("exits")],
        "bad_value": [fixture("nan")],
    }
    preload = [*specs, *(s for group in failing.values() for s in group)]
    async with open_ray_reward_pool("", 2, 3.0, preload=preload) as pool:
        assert pool.capacity == 2
        assert await pool.score("capitals", specs, ARGUMENTS) == 0.5 * 5 + 2.0
        for kind, failing_specs in failing.items():
            started = time.monotonic()
            with pytest.raises(RewardFailed) as caught:
                await pool.score("capitals", failing_specs, ARGUMENTS)
            assert caught.value.kind == kind, caught.value
            if kind == "timeout":
                assert 3.0 <= time.monotonic() - started < 20
        # After every failure the pool still scores.
        assert await pool.score("capitals", specs, ARGUMENTS) == 0.5 * 5 + 2.0
        assert pool.failures == {("capitals", kind): 1 for kind in failing}


async def test_a_fresh_workers_start_does_not_count_against_the_rewards_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reward module that takes longer to import than the deadline, and is not preloaded:
    # the task's worker imports it before the reward starts, as a fresh worker (after one
    # was killed, or on a node new to the run) must.
    (tmp_path / "slow_import_rewards.py").write_text(
        "import time\ntime.sleep(4)\ndef length(completion):\n    return float(len(completion))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = RewardSpec("slow_import_rewards:length", 1.0, ("completion",))
    async with open_ray_reward_pool("", 1, 3.0) as pool:
        started = time.monotonic()
        assert await pool.score("capitals", [spec], ARGUMENTS) == 5.0
        assert time.monotonic() - started >= 4
        assert pool.failures == {}


async def test_no_more_calls_are_on_the_cluster_than_it_can_take() -> None:
    naps = [fixture("naps")]  # 0.3 s each
    # One slot on an instance of this machine's CPUs (2 or more): Ray alone would run two
    # at once, so only the pool's own back-pressure keeps it to one.
    async with open_ray_reward_pool("", 1, 30.0, preload=naps) as pool:
        assert pool.capacity == 1
        await pool.score("x", naps, ARGUMENTS)  # the worker warm
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(pool.score, "x", naps, ARGUMENTS)
        # One at a time: six rounds of 0.3 s.
        assert time.monotonic() - started >= 6 * 0.3


async def test_the_demo_scores_on_ray_and_a_reward_that_fails_remotely_discards_its_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "remote_rewards.py").write_text(
        "def flaky(answer, completion):\n"
        "    if str(answer).endswith('3'):\n"
        "        raise RuntimeError('this reward fails on the cluster')\n"
        "    return float(str(answer) in completion)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(
        DEMO_CONFIG,
        [
            *demo_paths(tmp_path / "run"),
            f'env=[{{name = "arith", dataset = "{DEMO_DATA / "arith.jsonl"}", '
            'prompt = "question", '
            'answer = "answer", rewards = ["remote_rewards:flaky", '
            '"orchestrator.rewards:number_format"], max_tokens = 16}]',
            'eval.env.0.rewards=["remote_rewards:flaky"]',
            "eval.num_examples=16",
            "max_steps=3",
            'rewards.executor="ray"',
            "rewards.workers=2",
            "batch.curriculum_min_mean_reward=0.0",
            "sim.train_time_s=0.05",
            "trainer.poll_interval_s=0.1",
        ],
    )
    with trio.fail_after(240):
        outcome = await launch_run(config)
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    assert outcome.state.dispatch.rollouts["reward_failed"] > 0
    assert outcome.state.dispatch.rollouts["completed"] > 0
    evals = [json.loads(line) for line in config.evals_file.read_text().splitlines()]
    assert [line["version"] for line in evals] == [0, 3]
    assert all(line["envs"]["arith-eval"]["failures"].get("reward_failed") for line in evals)
