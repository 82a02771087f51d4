"""The real daemon with the local fleet, on a config where every sample is longer than
`batch.max_seq_len`: nothing ever ships, so the stall watch warns with `untrainable` as
the dominant discard reason, the `progress` lines before it show rollouts completing and
all of them discarded as `untrainable`, and `orchestrator status` says the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trio
from cli_kit import config_args

from orchestrator.cli import main
from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.daemon.run_state import RunState
from orchestrator.handoff import hold_run_lock, load_progress

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STALL_S = 0.5
REPORT_S = 0.2


def warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "no batch shipped"]


def untrainable(entry: dict[str, Any]) -> int:
    count: int = entry["discards"].get("untrainable", 0)
    return count


async def test_every_sample_too_long_warns_and_status_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        f'run_dir="{tmp_path / "run"}"',
        "sim.train_time_s=0.02",
        "trainer.poll_interval_s=0.1",
        "max_steps=2",
        # Every prompt alone is longer: each sample is discarded as untrainable.
        "batch.max_seq_len=8",
        f"progress.stall_warning_s={STALL_S}",
        f"progress.report_interval_s={REPORT_S}",
    ]
    config = load_config(DEMO, overrides)
    with (
        hold_run_lock(config.state_dir),
        structlog.testing.capture_logs() as logs,
        trio.fail_after(30),
    ):
        async with trio.open_nursery() as nursery:
            state: RunState = await nursery.start(launch_run, config)
            # Two warnings that saw discards: the first one's progress save is done. (Groups
            # keep being admitted and discarded, and each admission notifies the state.)
            while len([w for w in warnings(logs) if untrainable(w)]) < 2:
                await state.wait_changed()
            nursery.cancel_scope.cancel()

    assert state.shipping.next_step == 1, "a batch shipped although every sample is too long"
    stalls = warnings(logs)
    # Once per interval, not on every check; the first right after STALL_S of silence.
    assert 2 <= len(stalls) <= 20
    last = [w for w in stalls if untrainable(w)][-1]
    assert last["log_level"] == "warning"
    assert last["since"] == "start"
    assert last["step"] == 1 and last["needed_samples"] == config.batch.size
    assert last["queued_samples"] == 0
    # What took the groups with signal, with what it usually means (the others count
    # under what their rewards decided: no_signal, curriculum).
    assert set(last["discards"]) <= {"untrainable", "no_signal", "curriculum"}
    assert last["discards"]["untrainable"] > 0
    assert "max_seq_len" in last["hint"]

    # The progress lines came first (at info level), under the warning's names.
    lines = [entry for entry in logs if entry["event"] == "progress"]
    assert lines and logs.index(lines[0]) < logs.index(stalls[0])
    assert {line["log_level"] for line in lines} == {"info"}
    busy = [line for line in lines if line["discards"]]
    assert busy and all(
        set(line["discards"]) <= {"untrainable", "no_signal", "curriculum"} for line in busy
    )
    assert any("untrainable" in line["discards"] for line in busy)
    # A group is discarded after its last rollout completed, under load in a later
    # interval, whose line then has discards and no completions: the completions are in
    # that line's interval or an earlier one.
    first_busy = lines.index(busy[0])
    assert any(line["rollouts_per_s"] > 0 for line in lines[: first_busy + 1])
    assert {(line["step"], line["queued_samples"], line["needed_samples"]) for line in lines} == {
        (1, 0, config.batch.size)
    }

    # progress.json carries the same, and `orchestrator status` shows it.
    progress = load_progress(config.state_dir)
    assert progress is not None
    assert progress.last_shipped_at is None and progress.started_at > 0
    assert progress.recent_discards["untrainable"] >= untrainable(last)
    assert progress.last_report is not None and progress.last_report.step == 1
    assert progress.needed_samples == config.batch.size
    capsys.readouterr()
    argv = ["status", *config_args(DEMO, *overrides)]
    with hold_run_lock(config.state_dir):
        assert main(argv) == 0
    out = capsys.readouterr().out
    count = progress.recent_discards["untrainable"]
    assert "no batch shipped for" in out
    assert f"most discards: untrainable ({count})" in out, out
    assert "progress line:   step 1, 0 of" in out, out
