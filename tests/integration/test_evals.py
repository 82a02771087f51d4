"""Evals beside training, end to end against local servers the test starts (so it can read
their request counts afterwards): evals at the base model, every interval and the last
version, sent without payload capture, within their share of the in-flight limit; a
failed eval request or reward is counted and reported and the run goes on; a resumed run
evaluates the version it resumes at."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import structlog.testing
import trio
from demo_run import DEMO_CONFIG, DEMO_MODEL, demo_paths

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.handoff import shipped_steps
from orchestrator.sim.fleet import sim_inference_config
from orchestrator.sim.inference import serve_inference

pytestmark = pytest.mark.slow


def eval_config(run_dir: Path, urls: list[str], *overrides: str) -> Config:
    return load_config(
        DEMO_CONFIG,
        [
            *demo_paths(run_dir),
            "eval.num_examples=8",
            "eval.rollouts_per_example=2",
            # Half the demo's training batch (16): the evals beside it are what is checked.
            "batch.size=8",
            "rewards.workers=2",
            "sim.train_time_s=0.05",
            "trainer.poll_interval_s=0.1",
            "sim.inference_servers=0",
            f"inference.urls={json.dumps(urls)}",
            *overrides,
        ],
    )


@asynccontextmanager
async def two_servers(*overrides: str) -> AsyncIterator[list[str]]:
    """The demo's two local servers (with `overrides` of its config), started here."""
    fleet = load_config(DEMO_CONFIG, [*overrides, f'model.tokenizer="{DEMO_MODEL}"'])
    async with trio.open_nursery() as nursery:
        urls = [
            str(await nursery.start(serve_inference, sim_inference_config(fleet, index)))
            for index in range(2)
        ]
        yield urls
        nursery.cancel_scope.cancel()


async def healths(urls: list[str]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as client:
        return [(await client.get(f"{url}/health")).json() for url in urls]


def eval_lines(config: Config) -> list[dict[str, Any]]:
    return [json.loads(line) for line in config.evals_file.read_text().splitlines()]


async def test_evals_run_at_the_base_model_every_interval_and_the_last_without_payloads(
    tmp_path: Path,
) -> None:
    async with two_servers() as urls:
        config = eval_config(
            tmp_path / "run",
            urls,
            "max_steps=4",
            "eval.interval=2",
            'inference.inflight_limit="fixed"',
            "inference.max_inflight=8",
        )
        with structlog.testing.capture_logs() as logs, trio.fail_after(120):
            outcome: RunOutcome = await launch_run(config)
        served = await healths(urls)
    assert shipped_steps(config.batches_dir) == [1, 2, 3, 4]
    lines = eval_lines(config)
    assert [line["version"] for line in lines] == [0, 2, 4]
    for line in lines:
        result = line["envs"]["arith-eval"]
        assert result["samples"] + result["failed"] == 16 and result["prompts"] == 8
        assert set(result["pass_at"]) == {"1", "2"}
        assert 0 <= result["pass_at"]["1"] <= result["pass_at"]["2"] <= 1
        assert 0 < result["completion_tokens_mean"] <= 16
        assert min(result["versions"]) >= line["version"]
    assert [entry["version"] for entry in logs if entry["event"] == "eval"] == [0, 2, 4]
    evaluation = outcome.state.evaluation
    assert evaluation.evals == 3 and evaluation.rollouts["scored"] == 48
    assert evaluation.last is not None and evaluation.last.version == 4
    # Every training request named a payload directory (the demo is by handle), a file
    # for each rollout's turn; the eval requests, single-turn, one per sample, named none.
    requests = sum(h["requests_served"] for h in served)
    with_payloads = sum(h["payload_requests"] for h in served)
    assert requests - with_payloads == 3 * 16
    assert sum(h["payload_files_written"] for h in served) >= 4 * config.batch.size
    # Beside training, evals never held more than their share of the limit.
    assert 1 <= evaluation.peak_inflight <= math.floor(0.25 * 8)
    # And the report's record of training: a line per shipped batch.
    steps = [json.loads(line) for line in config.steps_file.read_text().splitlines()]
    assert [line["step"] for line in steps] == [1, 2, 3, 4]
    for line in steps:
        assert line["samples"] == config.batch.size
        assert 0 <= line["staleness_mean"] <= line["staleness_max"] <= 2
        assert set(line["reward_by_env"]) <= {"arith", "chat"}
    assert steps[-1]["rollouts"]["completed"] <= outcome.state.dispatch.rollouts["completed"]


FLAKY = """
def flaky(answer, completion):
    if str(answer).endswith(("3", "5")):
        raise RuntimeError("this eval reward has a bug")
    return 1.0 if str(answer) in completion else 0.0
"""


async def test_failed_eval_requests_and_rewards_are_counted_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flaky_eval.py").write_text(FLAKY)
    monkeypatch.chdir(tmp_path)
    async with two_servers("sim.http_500_rate=0.2") as urls:
        config = eval_config(
            tmp_path / "run",
            urls,
            "max_steps=3",
            "eval.num_examples=32",
            "inference.retries=0",
            # One request per rollout: training's few groups meet the fault rate in
            # dozens of requests, not in a handful (0.8^8 of runs would see none).
            "inference.group_request=false",
            'eval.env.0.rewards=["flaky_eval:flaky"]',
        )
        with trio.fail_after(120):
            outcome = await launch_run(config)
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    lines = eval_lines(config)
    assert [line["version"] for line in lines] == [0, 3]
    failures: dict[str, int] = {}
    for line in lines:
        result = line["envs"]["arith-eval"]
        assert result["samples"] + result["failed"] == 64 and result["samples"] > 0
        assert sum(result["failures"].values()) == result["failed"]
        for kind, count in result["failures"].items():
            failures[kind] = failures.get(kind, 0) + count
    assert failures.get("reward_failed", 0) > 0 and failures.get("http_5xx", 0) > 0
    evaluation = outcome.state.evaluation
    assert evaluation.failures["reward_failed"] == failures["reward_failed"]
    assert evaluation.failures["http_5xx"] == failures["http_5xx"]
    # Training's failures are its own.
    assert outcome.state.dispatch.failures["http_5xx"] > 0
    assert "reward_failed" not in outcome.state.dispatch.failures


async def test_a_resumed_run_evaluates_the_version_it_resumes_at(tmp_path: Path) -> None:
    async with two_servers() as urls:
        first = eval_config(tmp_path / "run", urls, "max_steps=2")
        with trio.fail_after(120):
            await launch_run(first)
        resumed = eval_config(tmp_path / "run", urls, "max_steps=4")
        with trio.fail_after(120):
            outcome = await launch_run(resumed)
        skipping = attrs.evolve(
            resumed, max_steps=5, eval=attrs.evolve(resumed.eval, skip_eval_on_resume=True)
        )
        with trio.fail_after(120):
            await launch_run(skipping)
    assert outcome.first_step == 3
    lines = eval_lines(resumed)
    assert [(line["version"], line["resumed"]) for line in lines] == [
        (0, False),
        (2, False),
        (2, True),
        (4, False),
        (5, False),
    ]
