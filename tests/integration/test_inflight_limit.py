"""The adaptive in-flight limit end to end: local servers that generate only a few requests
at once (the rest queue, as in vLLM), a daemon allowed far more in flight than they turn
around within a step. The limit comes down, is reported, and the run keeps its invariants."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog.testing
import trio

from orchestrator.config import Config
from orchestrator.handoff import load_progress

from .test_daemon import assert_invariants, demo_config, run_with_watch

STEPS = 8


def overloaded(run_dir: Path, mode: str, steps: int = STEPS) -> Config:
    return demo_config(
        run_dir,
        f"max_steps={steps}",
        "sim.inference_servers=1",
        # Four requests at a time, 16 tokens at 2 ms each: about 120 requests a second.
        "sim.max_num_seqs=4",
        "sim.time_per_token_s=0.002",
        "sim.max_tokens=16",
        # No slack to spare: a group dispatched while the last batch it may go into is
        # being filled must finish before that batch ships.
        "staleness.max_off_policy_steps=1",
        "staleness.max_async_steps=1",
        "inference.max_inflight=64",
        f'inference.inflight_limit="{mode}"',
    )


@pytest.mark.slow
async def test_an_overloaded_fleet_gets_a_lower_limit_and_the_run_keeps_its_invariants(
    tmp_path: Path,
) -> None:
    config = overloaded(tmp_path / "run", "adaptive")
    with structlog.testing.capture_logs() as logs, trio.fail_after(240):
        outcome, _ = await run_with_watch(config)
    assert_invariants(config, outcome, STEPS)
    decisions = [entry for entry in logs if entry["event"] == "inflight limit"]
    assert decisions, "the limit never changed"
    for entry in decisions:
        assert config.batch.group_size <= entry["limit"] <= config.inference.max_inflight
        assert entry["turnaround_p90_s"] > 0 and entry["step_time_s"] > 0
        assert entry["slack_used_p90"] > 0
    # Far more was allowed than two request slots turn around in a step: it came down.
    assert min(entry["limit"] for entry in decisions) < config.inference.max_inflight
    assert outcome.state.limits.rollouts == decisions[-1]["limit"]
    progress = load_progress(config.state_dir)
    assert progress is not None and progress.inflight_limit == outcome.state.limits.rollouts


@pytest.mark.slow
async def test_a_fixed_limit_stays_where_it_is_set(tmp_path: Path) -> None:
    config = overloaded(tmp_path / "run", "fixed", steps=4)
    with structlog.testing.capture_logs() as logs, trio.fail_after(240):
        outcome, _ = await run_with_watch(config)
    assert_invariants(config, outcome, 4)
    assert not [entry for entry in logs if entry["event"] == "inflight limit"]
    assert outcome.state.limits.rollouts == config.inference.max_inflight
