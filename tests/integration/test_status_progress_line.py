"""`orchestrator status` shows the daemon's last `progress` line from `progress.json`:
samples ready of those needed, rollouts in flight and per second, the discards and
failures over the line's interval; older progress files without these keys still read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from run_kit import write_run_toml

from orchestrator.cli import main
from orchestrator.handoff import (
    PROGRESS_FILE,
    Progress,
    ProgressLine,
    load_progress,
    save_progress,
)

# What a daemon from before the progress line wrote.
OLD_PROGRESS = {
    "applied_version": 0,
    "bound": None,
    "discards": {"untrainable": 7},
    "inflight_rollouts": 2,
    "pid": 1,
    "queued_samples": 0,
    "step": 0,
    "updated_at": 1.0,
    "started_at": 1.0,
    "last_shipped_at": None,
    "failures": {},
    "recent_discards": {"untrainable": 7},
    "recent_failures": {},
    "top_error": None,
}

LINE = ProgressLine(
    step=4,
    queued_samples=5,
    needed_samples=16,
    inflight_rollouts=64,
    interval_s=30.0,
    rollouts_per_s=12.4,
    discards={"untrainable": 372, "stale": 2},
    failures={"malformed": 3},
    scored={"arith": 40, "chat": 12},
    mean_reward={"arith": 0.0625, "chat": 0.1667},
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    state_dir = tmp_path / "run" / "orchestrator"
    state_dir.mkdir(parents=True)
    return state_dir


@pytest.fixture
def config_file(tmp_path: Path, state_dir: Path) -> Path:
    return write_run_toml(tmp_path / "run.toml", state_dir.parent)


def progress(now: float, line: ProgressLine | None = LINE) -> Progress:
    return Progress(
        step=3,
        applied_version=2,
        bound=0,
        inflight_rollouts=64,
        queued_samples=5,
        discards={"untrainable": 4000, "stale": 2},
        updated_at=now - 2,
        pid=4242,
        started_at=now - 600,
        last_shipped_at=now - 40,
        needed_samples=16,
        last_report=line,
        last_report_at=None if line is None else now - 2,
    )


def status(capsys: pytest.CaptureFixture[str], config_file: Path, *extra: str) -> str:
    assert main(["status", "--config", str(config_file), *extra]) == 0
    return capsys.readouterr().out


def facts(out: str) -> dict[str, str]:
    return {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in out.splitlines()
        if line.startswith("  ") and ":" in line
    }


def test_progress_round_trips_the_line(state_dir: Path) -> None:
    saved = progress(time.time())
    save_progress(state_dir, saved)
    assert load_progress(state_dir) == saved
    save_progress(state_dir, progress(time.time(), line=None))
    loaded = load_progress(state_dir)
    assert loaded is not None and loaded.last_report is None


def test_an_older_progress_file_still_reads(state_dir: Path) -> None:
    (state_dir / PROGRESS_FILE).write_text(json.dumps(OLD_PROGRESS))
    loaded = load_progress(state_dir)
    assert loaded is not None
    assert (loaded.needed_samples, loaded.last_report, loaded.last_report_at) == (0, None, None)
    assert loaded.recent_discards == {"untrainable": 7}


def test_status_shows_the_last_progress_line(
    state_dir: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_progress(state_dir, progress(time.time()))
    out = status(capsys, config_file)
    document = json.loads(status(capsys, config_file, "--json"))
    shown = facts(out)
    assert shown["in flight"].startswith("64 rollouts, 5 of 16 queued samples (as of ")
    line = shown["progress line"]
    assert line.startswith(
        "step 4, 5 of 16 samples ready, 64 rollouts in flight, 12.4 rollouts/s; "
        "discards stale 2, untrainable 372; failures malformed 3; "
        "mean reward arith 0.0625 over 40, chat 0.167 over 12 (over the 30 s to "
    )
    assert line.endswith(" s ago)")
    # The same figures as the log line, under the same names.
    assert document["progress"]["last_report"] == LINE.to_json()
    assert document["progress"]["needed_samples"] == 16
    assert document["progress"]["last_report_at"] > 0


def test_a_quiet_interval_and_an_old_file(
    state_dir: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = ProgressLine(1, 0, 16, 8, 30.0, 0.0)
    save_progress(state_dir, progress(time.time(), line=quiet))
    assert (
        "0 rollouts/s; no discards; no failures"
        in facts(status(capsys, config_file))["progress line"]
    )

    (state_dir / PROGRESS_FILE).write_text(json.dumps(OLD_PROGRESS))
    out = status(capsys, config_file)
    document = json.loads(status(capsys, config_file, "--json"))
    assert "progress line" not in facts(out)
    assert facts(out)["in flight"].startswith("2 rollouts, 0 queued samples (as of ")
    assert document["progress"]["last_report"] is None
