"""`orchestrator status` on whether batches ship: "no batch shipped for N s" with the
dominant discard reason and the most common error while a daemon holds the run and has
been quiet for `[progress] stall_warning_s`, from `progress.json` (old files still read)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from run_kit import write_run_toml

from orchestrator.cli import main
from orchestrator.daemon.rejections import TopError
from orchestrator.handoff import (
    PROGRESS_FILE,
    Progress,
    hold_run_lock,
    load_progress,
    save_progress,
)

# What a daemon from before these keys wrote.
OLD_PROGRESS = {
    "applied_version": 0,
    "bound": None,
    "discards": {"untrainable": 7},
    "inflight_rollouts": 2,
    "pid": 1,
    "queued_samples": 0,
    "step": 0,
    "updated_at": 1.0,
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "orchestrator").mkdir(parents=True)
    return run_dir


@pytest.fixture
def config_file(tmp_path: Path, run_dir: Path) -> Path:
    return write_run_toml(tmp_path / "run.toml", run_dir, "[progress]\nstall_warning_s = 60\n")


def stalled_progress(now: float, *, last_shipped_at: float | None = None) -> Progress:
    return Progress(
        step=0,
        applied_version=0,
        bound=None,
        discards={"untrainable": 4512, "stale": 0},
        updated_at=now - 1,
        pid=4242,
        started_at=now - 120,
        last_shipped_at=last_shipped_at,
        failures={"malformed": 903},
        recent_discards={"untrainable": 4512},
        recent_failures={"malformed": 903},
        top_error=TopError("malformed", "response is not JSON (JSONDecodeError)", 903),
    )


def status(capsys: pytest.CaptureFixture[str], config_file: Path, *extra: str) -> str:
    assert main(["status", "--config", str(config_file), *extra]) == 0
    return capsys.readouterr().out


def shipping_line(out: str) -> str | None:
    lines = [line for line in out.splitlines() if line.strip().startswith("shipping:")]
    return lines[0] if lines else None


def test_progress_round_trips_the_new_keys(run_dir: Path) -> None:
    progress = stalled_progress(time.time())
    save_progress(run_dir / "orchestrator", progress)
    assert load_progress(run_dir / "orchestrator") == progress


def test_an_old_progress_file_still_reads(run_dir: Path) -> None:
    (run_dir / "orchestrator" / PROGRESS_FILE).write_text(json.dumps(OLD_PROGRESS))
    progress = load_progress(run_dir / "orchestrator")
    assert progress is not None
    assert progress.discards == {"untrainable": 7}
    assert progress.started_at == 0.0 and progress.last_shipped_at is None
    assert progress.failures == {} and progress.top_error is None


def test_a_quiet_running_daemon_is_reported_stalled(
    run_dir: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_progress(run_dir / "orchestrator", stalled_progress(time.time()))
    with hold_run_lock(run_dir / "orchestrator"):
        out = status(capsys, config_file)
        document = json.loads(status(capsys, config_file, "--json"))
    line = shipping_line(out)
    assert line is not None
    assert "no batch shipped for 12" in line  # 120 s, give or take the test's own time
    assert "most discards: untrainable (4512)" in line
    assert "most common error: malformed: response is not JSON (JSONDecodeError) (903x)" in line
    assert "failures:        malformed 903" in out
    assert document["shipping"]["stalled"] is True
    assert document["shipping"]["stall_warning_s"] == 60
    assert document["progress"]["top_error"]["count"] == 903
    assert document["progress"]["recent_discards"] == {"untrainable": 4512}


def test_a_stopped_daemon_or_a_recent_batch_is_not_a_stall(
    run_dir: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    save_progress(run_dir / "orchestrator", stalled_progress(now))
    line = shipping_line(status(capsys, config_file))  # nobody holds the lock
    assert line is not None and "none since the daemon started" in line
    assert "no batch shipped" not in line

    save_progress(run_dir / "orchestrator", stalled_progress(now, last_shipped_at=now - 5))
    with hold_run_lock(run_dir / "orchestrator"):
        line = shipping_line(status(capsys, config_file))
    assert line is not None and line.split(":", 1)[1].strip().startswith("last batch shipped")


def test_an_old_progress_file_has_no_shipping_line(
    run_dir: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run_dir / "orchestrator" / PROGRESS_FILE).write_text(json.dumps(OLD_PROGRESS))
    with hold_run_lock(run_dir / "orchestrator"):
        out = status(capsys, config_file)
        document = json.loads(status(capsys, config_file, "--json"))
    assert shipping_line(out) is None
    assert "discards:        untrainable 7" in out
    assert document["shipping"] == {
        "quiet_s": None,
        "stall_warning_s": 60,
        "stalled": False,
        "summary": None,
    }
