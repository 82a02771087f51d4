"""`orchestrator-trainer` as a user runs it: beside a daemon on the local fleet, stopped
and started again, and refusing what it cannot train in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"


def overrides(run_dir: Path, model: Path, *more: str) -> list[str]:
    """The demo on the local fleet, its routing shaped as the tiny model's, no trainer of
    its own, no evals."""
    sets = [
        f'run_dir="{run_dir}"',
        f'model.path="{model}"',
        "sim.trainer=false",
        "sim.layers=2",
        "sim.top_k=2",
        "sim.num_experts=8",
        "eval.interval=0",
        "eval.eval_base_model=false",
        "rewards.workers=1",
        "trainer.poll_interval_s=0.05",
        "train.learning_rate=1e-3",
        *more,
    ]
    return [arg for item in sets for arg in ("--set", item)]


def trainer(run_dir: Path, model: Path, *more: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "orchestrator_trainer", "--config", str(DEMO)]
    return subprocess.Popen(
        [*command, *overrides(run_dir, model, *more)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_restarted_trainer_goes_on_from_its_last_version(tiny_moe: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    daemon_log = tmp_path / "daemon.log"  # its log and, last, its summary
    with daemon_log.open("w") as log_file:  # the child holds its own copy
        daemon = subprocess.Popen(
            [
                *(sys.executable, "-m", "orchestrator.cli", "run", "--config", str(DEMO)),
                *overrides(run_dir, tiny_moe, "max_steps=4"),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        first = trainer(run_dir, tiny_moe, "max_steps=2")
        _, first_log = first.communicate(timeout=240)
        assert first.returncode == 0, first_log
        second = trainer(run_dir, tiny_moe, "max_steps=4")
        _, second_log = second.communicate(timeout=240)
        assert second.returncode == 0, second_log
        assert daemon.wait(timeout=120) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    lines = [json.loads(line) for line in (run_dir / "trainer.jsonl").read_text().splitlines()]
    assert [(line["step"], line["version"]) for line in lines] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert all(line["samples"] == 16 and line["tokens"] > 0 for line in lines)
    started = [json.loads(line) for line in second_log.splitlines() if "trainer started" in line]
    assert started and started[0]["version"] == 2, second_log
    assert "afresh" not in second_log
    # The trainer's report, counted on across the restart, as the simulated trainer
    # writes it: the run's summary checks every invariant against it.
    report = json.loads((run_dir / "trainer" / "report.json").read_text())
    assert report["format"] == "rollout-orchestrator.trainer-report/1"
    assert (report["first_step"], report["last_step"], report["steps"]) == (1, 4, 4)
    assert report["samples"] == 64 and report["payload_bytes"] > 0
    assert report["violations"] == [] and report["dropped"] == []
    summary = daemon_log.read_text()
    assert "ok   no payload violations: the trainer read 64 samples of 4 batches" in summary


def test_a_signal_stops_it_between_steps(tiny_moe: Path, tmp_path: Path) -> None:
    log_file = tmp_path / "trainer.log"
    command = [sys.executable, "-m", "orchestrator_trainer", "--config", str(DEMO)]
    with log_file.open("w") as out:
        process = subprocess.Popen(
            [*command, *overrides(tmp_path / "run", tiny_moe)], cwd=ROOT, stderr=out
        )
    deadline = time.monotonic() + 120
    while "trainer started" not in log_file.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log_file.read_text()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, log_file.read_text()
    assert "trainer stopped" in log_file.read_text()


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (['model.path="/nonexistent/model"'], "is not a Hugging Face model folder"),
        (['trainer.format="prime-rl"', 'trainer.weights_layout="prime-rl"'], "native batches only"),
        (["train.learning_rate=0"], "train.learning_rate"),
    ],
)
def test_what_it_cannot_train_is_one_line(
    tiny_moe: Path, tmp_path: Path, more: list[str], message: str
) -> None:
    process = trainer(tmp_path / "run", tiny_moe, *more)
    _, log = process.communicate(timeout=120)
    assert process.returncode == 2
    assert log.count("\n") == 1 and message in log, log
    assert log.startswith("orchestrator-trainer: error:")
