"""The end-of-run invariants catch what they are for: a gap in the batches, a trainer
violation, a version directory left below the bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
from sample_kit import train_sample

from orchestrator.commands.summary import (
    check_invariants,
    invariants_hold,
    render_summary,
    summary_data,
)
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.run_state import RunState, Shipping
from orchestrator.daemon.run_totals import EnvTotals, RunTotals, run_totals
from orchestrator.handoff import NATIVE_FORMAT, HandoffSettings, publish_batch


def totals_of(state: RunState) -> RunTotals:
    """`state`'s totals with an empty sink (the summary's invariants are the subject)."""
    limits = SinkLimits(
        batch_size=4,
        constant_size=True,
        staleness=state.staleness,
        curriculum_min_mean_reward=0.0,
        curriculum_max_mean_reward=1.0,
        max_seq_len=64,
    )
    return run_totals(state, TrainSink(limits))


def layout(tmp_path: Path, steps: list[int], dirs: list[str], violations: int) -> dict[str, Any]:
    batches, root = tmp_path / "batches", tmp_path / "payloads"
    for step in steps:
        publish_batch(batches, step, [train_sample()], fsync=False)
    for name in dirs:
        (root / name).mkdir(parents=True)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"steps": 3, "samples": 3, "violations": [{}] * violations}))
    return {
        "handoff": NATIVE_FORMAT,
        "settings": HandoffSettings(batches),
        "payload_root": root,
        "trainer_report": report,
    }


def test_a_clean_run_holds_every_invariant(tmp_path: Path) -> None:
    paths = layout(tmp_path, [1, 2, 3], ["v2", "v3", "other"], violations=0)
    invariants = check_invariants(**paths, last_step=3, bound=2)
    assert [i.held for i in invariants] == [True, True, True]


def test_each_broken_invariant_is_reported(tmp_path: Path) -> None:
    paths = layout(tmp_path, [1, 3], ["v0", "v1", "v2"], violations=2)
    invariants = check_invariants(**paths, last_step=3, bound=2)
    assert [i.held for i in invariants] == [False, False, False]
    assert "left below v2: [0, 1]" in invariants[2].detail
    state = RunState(Staleness(2, 1), Shipping(3))
    totals = attrs.evolve(totals_of(state), discards={"stale": 1})
    data = summary_data(totals, invariants, duration_s=1.0, first_step=1)
    assert not invariants_hold(data)
    text = render_summary(data)
    assert text.count("FAIL") == 3 and "stale 1" in text


def test_no_trainer_report_is_not_a_failure(tmp_path: Path) -> None:
    paths = layout(tmp_path, [1], [], violations=0)
    paths["trainer_report"].unlink()
    invariants = check_invariants(**paths, last_step=1, bound=None)
    assert [i.held for i in invariants] == [True, None, None]
    state = RunState(Staleness(2, 1), Shipping(1))
    assert invariants_hold(summary_data(totals_of(state), invariants, duration_s=0, first_step=1))


def test_dropped_samples_are_shown_by_server_and_fail_nothing(tmp_path: Path) -> None:
    paths = layout(tmp_path, [1, 2, 3], ["v2"], violations=0)
    report = json.loads(paths["trainer_report"].read_text())
    a, b = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    report["dropped"] = [{"server": a}, {"server": b}, {"server": a}, {"server": None}]
    paths["trainer_report"].write_text(json.dumps(report))
    invariants = check_invariants(**paths, last_step=3, bound=2)
    assert [i.held for i in invariants] == [True, True, True]
    detail = invariants[1].detail
    assert f"4 samples dropped for broken payloads ({a} 2, {b} 1, unknown server 1)" in detail
    state = RunState(Staleness(2, 1), Shipping(3))
    data = summary_data(totals_of(state), invariants, duration_s=1.0, first_step=1)
    assert invariants_hold(data)
    assert "4 samples dropped" in render_summary(data)


def test_a_payload_root_payload_gc_refuses_is_not_checked(tmp_path: Path) -> None:
    paths = layout(tmp_path, [1], ["v0"], violations=0)
    real = paths["payload_root"].rename(tmp_path / "real")
    paths["payload_root"].symlink_to(real, target_is_directory=True)
    collected = check_invariants(**paths, last_step=1, bound=2)[2]
    assert collected.held is None
    assert "is a symbolic link" in collected.detail
    paths["payload_root"].unlink()
    assert check_invariants(**paths, last_step=1, bound=2)[2].held is True


def test_an_environments_own_metrics_are_summarized_as_means() -> None:
    state = RunState(Staleness(2, 1), Shipping(3))
    env = EnvTotals(4, 2.0, 4, {}, 0, {"turns": 2.0, "tool_calls": 0.5})
    totals = attrs.evolve(totals_of(state), envs={"tools": env})
    data = summary_data(totals, [], duration_s=1.0, first_step=1)
    assert data["envs"]["tools"]["metrics"] == {"tool_calls": 0.5, "turns": 2.0}
    assert "metrics (means) tool_calls 0.5, turns 2" in render_summary(data)


def test_the_daemons_cpu_is_given_per_completed_rollout() -> None:
    state = RunState(Staleness(2, 1), Shipping(3))
    totals = attrs.evolve(totals_of(state), rollouts={"completed": 400})
    data = summary_data(totals, [], duration_s=9.0, first_step=1, cpu_s=6.0, workers_cpu_s=2.5)
    assert data["cpu"] == {"daemon_s": 6.0, "daemon_s_per_rollout": 0.015, "workers_s": 2.5}
    assert (
        "cpu            daemon 6.0 s, 15.00 ms per completed rollout; "
        "reward and environment workers 2.5 s"
    ) in render_summary(data)
    # Not measured (a caller that gives none): no line.
    assert "cpu " not in render_summary(summary_data(totals, [], duration_s=9.0, first_step=1))
