"""`orchestrator sim-trainer --format prime-rl`: the local trainer standing in for
prime-rl's, reading `step_N/rank_R.bin` for every data rank, counting what is wrong, and
publishing `step_N/STABLE`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from cli_kit import config_args, refused
from sample_kit import by_handle_sample

from orchestrator.cli import main
from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff import published_versions
from orchestrator.handoff.primerl import decode_rank_file, publish_primerl_step

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def settings(run_dir: Path, max_steps: int) -> list[str]:
    fast = ("sim.train_time_s=0.0", "trainer.poll_interval_s=0.05")
    return config_args(CONFIG, f'run_dir="{run_dir}"', f"max_steps={max_steps}", *fast)


def sample(run_dir: Path, name: str, length: int) -> TrainSample:
    routing = np.arange((length - 1) * 4, dtype=np.uint32).reshape(length - 1, 2, 2) % 128
    return by_handle_sample(
        run_dir / "payloads" / "v0",
        [{"routed_experts": (routing.astype(np.uint8), 0)}],
        length,
        prompt=2,
        logprob=0.0,
        advantage=1.0,
        rollout_id=name,
        token_ids=range(length),
        server="http://127.0.0.1:9",
    )


def ship(run_dir: Path, step: int, count: int = 3) -> Path:
    samples = [sample(run_dir, f"r{step}-{i}", 6 + i) for i in range(count)]
    shipped = publish_primerl_step(
        run_dir / "batches",
        step,
        samples,
        data_world_size=2,
        seq_len=2048,
        env_name="mixed",
        fsync=False,
    )
    return shipped.path


def report(run_dir: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((run_dir / "trainer" / "report.json").read_text())
    return document


def test_reads_every_rank_and_publishes_in_the_prime_rl_layout(tmp_path: Path) -> None:
    for step in (1, 2):
        ship(tmp_path, step)
    flags = ["--format", "prime-rl", "--data-world-size", "2"]
    assert main(["sim-trainer", *settings(tmp_path, 2), *flags]) == 0
    weights_dir = tmp_path / "weights"
    assert sorted(p.name for p in weights_dir.iterdir()) == ["step_1", "step_2"]
    assert published_versions(weights_dir, layout="prime-rl") == [1, 2]
    got = report(tmp_path)
    assert (got["steps"], got["samples"], got["violations"]) == (2, 6, [])


def test_a_broken_step_is_a_violation_and_training_goes_on(tmp_path: Path) -> None:
    step_dir = ship(tmp_path, 1)
    rank = step_dir / "rank_1.bin"
    micro_batches = decode_rank_file(rank.read_bytes())
    micro_batches[0].input_ids = micro_batches[0].input_ids[:-1]
    rank.write_bytes(msgspec.msgpack.encode(micro_batches))
    ship(tmp_path, 2)
    args = ["--set", 'trainer.format="prime-rl"', "--set", 'trainer.weights_layout="prime-rl"']
    args += ["--set", "trainer.data_world_size=2"]
    assert main(["sim-trainer", *settings(tmp_path, 2), *args]) == 1
    assert published_versions(tmp_path / "weights", layout="prime-rl") == [1, 2]
    violations = report(tmp_path)["violations"]
    assert violations
    assert {(v["step"], v["kind"]) for v in violations} == {(1, "bad_micro_batch")}


def test_samples_the_daemon_dropped_are_reported_with_their_server(tmp_path: Path) -> None:
    samples = [sample(tmp_path, f"r{i}", 8) for i in range(3)]
    (Path(samples[1].payload_dir or "") / samples[1].payload["routed_experts"][0].file).unlink()
    publish_primerl_step(
        tmp_path / "batches",
        1,
        samples,
        data_world_size=2,
        seq_len=64,
        env_name="math",
        fsync=False,
    )
    flags = ["--format", "prime-rl", "--data-world-size", "2"]
    # A payload file missing while its sample was queued breaks the hand-off: exit 1.
    assert main(["sim-trainer", *settings(tmp_path, 1), *flags]) == 1
    got = report(tmp_path)
    assert got["samples"] == 2
    [dropped] = got["dropped"]
    assert (dropped["rollout_id"], dropped["server"], dropped["reason"]) == (
        "r1",
        "http://127.0.0.1:9",
        "payload_missing",
    )
    assert [v["kind"] for v in got["violations"]] == ["payload_missing"]


def test_the_prime_rl_format_with_the_native_layout_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--format", "prime-rl", "--weights-layout", "native"]
    assert "prime-rl" in refused(capsys, "sim-trainer", *settings(tmp_path, 1), *args)
    assert not (tmp_path / "weights").exists()


def test_a_bad_data_world_size_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, "sim-trainer", *settings(tmp_path, 1), "--data-world-size", "0")
    assert "--data-world-size" in err
