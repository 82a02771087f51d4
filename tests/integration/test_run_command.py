"""`orchestrator run` as a real process: SIGTERM stops it gracefully, and a run that is
started again resumes and finishes with its summary."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_kit import ORCHESTRATOR, config_args, process_refused

from orchestrator.handoff import shipped_steps

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


def run_command(run_dir: Path, *overrides: str) -> list[str]:
    sets = (f'run_dir="{run_dir}"', "sim.train_time_s=0.05", "trainer.poll_interval_s=0.1")
    return [*ORCHESTRATOR, "run", *config_args(DEMO, *sets, *overrides)]


def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_sigterm_stops_gracefully_and_a_restart_finishes_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    batches = run_dir / "batches"
    # The demo's evals (at the base model and the last version) with 16 samples, not 128:
    # the stop and the restart are what is checked here.
    evals = ("eval.num_examples=8", "eval.rollouts_per_example=2")
    process = subprocess.Popen(
        run_command(run_dir, "max_steps=6", "sim.train_time_s=0.3", *evals),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: batches.exists() and len(shipped_steps(batches)) >= 2, 60)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert b"Traceback" not in stderr
    shipped = shipped_steps(batches)
    assert 2 <= len(shipped) < 6 and shipped == list(range(1, len(shipped) + 1))
    progress = json.loads((run_dir / "orchestrator" / "progress.json").read_text())
    assert progress["step"] == shipped[-1]

    summary = tmp_path / "summary.json"
    finished = subprocess.run(
        [*run_command(run_dir, "max_steps=6", *evals), "--summary-json", str(summary)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr.decode()[-2000:]
    assert shipped_steps(batches) == [1, 2, 3, 4, 5, 6]
    data = json.loads(summary.read_text())
    assert data["first_step"] == shipped[-1] + 1
    assert data["steps"] == 6
    assert all(inv["held"] is True for inv in data["invariants"]), data["invariants"]
    assert b"== run summary ==" in finished.stderr


def test_a_bad_override_is_one_line_and_exit_two(tmp_path: Path) -> None:
    err = process_refused(run_command(tmp_path / "run", "staleness.max_async_steps=5"))
    assert "max_async_steps" in err
