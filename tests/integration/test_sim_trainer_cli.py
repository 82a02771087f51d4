"""`orchestrator sim-trainer` as a real process: exit codes, the report, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cli_kit import ORCHESTRATOR, config_args, refused
from sample_kit import by_handle_sample

from orchestrator.cli import main
from orchestrator.handoff import publish_batch, published_versions

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
ERROR = "orchestrator sim-trainer: error: "


def _settings(run_dir: Path, max_steps: int) -> list[str]:
    return config_args(
        CONFIG,
        f'run_dir="{run_dir}"',
        f"max_steps={max_steps}",
        "sim.train_time_s=0.0",
        "trainer.force_polling=true",
        "trainer.poll_interval_s=0.05",
    )


def _command(run_dir: Path, max_steps: int) -> list[str]:
    return [*ORCHESTRATOR, "sim-trainer", *_settings(run_dir, max_steps), "--log-json"]


def _ship(run_dir: Path, step: int) -> Path:
    """Ship one batch of one sample whose routing is in a real payload file under v0."""
    routing = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    payload_dir = run_dir / "payloads" / "v0"
    sample = by_handle_sample(
        payload_dir,
        [{"routed_experts": (routing, 0)}],
        6,
        prompt=3,
        logprob=0.0,
        advantage=1.0,
        rollout_id=f"r{step}",
        token_ids=range(6),
    )
    publish_batch(run_dir / "batches", step, [sample], fsync=False)
    return payload_dir / sample.payload["routed_experts"][0].file


def _report(run_dir: Path) -> dict[str, object]:
    report: dict[str, object] = json.loads((run_dir / "trainer" / "report.json").read_text())
    return report


def test_trains_max_steps_and_exits_zero(tmp_path: Path) -> None:
    for step in (1, 2):
        _ship(tmp_path, step)
    done = subprocess.run(_command(tmp_path, 2), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert published_versions(tmp_path / "weights") == [1, 2]
    report = _report(tmp_path)
    assert (report["steps"], report["samples"], report["violations"]) == (2, 2, [])
    events = [json.loads(line)["event"] for line in done.stderr.splitlines()]
    # One line per step, between the start and the final summary.
    assert events == ["trainer started", "trained", "trained", "trainer stopped"]


def test_a_violation_makes_the_exit_status_one(tmp_path: Path) -> None:
    _ship(tmp_path, 1)
    _ship(tmp_path, 2).unlink()
    done = subprocess.run(_command(tmp_path, 2), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert published_versions(tmp_path / "weights") == [1, 2]
    violations = _report(tmp_path)["violations"]
    assert isinstance(violations, list)
    [violation] = violations
    assert violation["kind"] == "payload_missing"
    assert violation["step"] == 2


def test_sigterm_stops_a_waiting_trainer_cleanly(tmp_path: Path) -> None:
    _ship(tmp_path, 1)
    process = subprocess.Popen(
        _command(tmp_path, 0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # Ready once it has published v1 and waits for batch 2, which never comes.
        deadline = time.monotonic() + 30
        while published_versions(tmp_path / "weights") != [1]:
            assert time.monotonic() < deadline, "the trainer did not publish v1"
            assert process.poll() is None, process.communicate()
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert json.loads(stderr.splitlines()[-1])["event"] == "trainer stopped"
    assert published_versions(tmp_path / "weights") == [1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "max_steps=-1"], "max_steps"),
        (["--set", "sim.train_time_s=fast"], "sim.train_time_s"),
    ],
)
def test_bad_config_is_one_line_and_exit_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    err = refused(capsys, "sim-trainer", *_settings(tmp_path, 1), *extra, prefix=ERROR)
    assert message in err
    assert not (tmp_path / "weights").exists()


def test_an_unwritable_run_dir_is_one_line_and_exit_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = refused(capsys, "sim-trainer", *_settings(blocker / "run", 1), prefix=ERROR)
    assert err.startswith(f"{ERROR}local trainer: ")
    assert "Not a directory" in err


@pytest.mark.parametrize(
    "layout_args",
    [
        ["--weights-layout", "prime-rl"],
        ["--set", 'trainer.weights_layout="prime-rl"'],
        # The flag wins over the config.
        ["--set", 'trainer.weights_layout="native"', "--weights-layout", "prime-rl"],
    ],
)
def test_publishes_in_the_prime_rl_layout_when_asked(
    tmp_path: Path, layout_args: list[str]
) -> None:
    for step in (1, 2):
        _ship(tmp_path, step)
    assert main(["sim-trainer", *_settings(tmp_path, 2), *layout_args]) == 0
    weights_dir = tmp_path / "weights"
    assert sorted(p.name for p in weights_dir.iterdir()) == ["step_1", "step_2"]
    assert published_versions(weights_dir, layout="prime-rl") == [1, 2]
    assert published_versions(weights_dir) == []


def test_an_unknown_weights_layout_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, "sim-trainer", *_settings(tmp_path, 1), "--weights-layout", "prime_rl")
    assert "--weights-layout" in err
