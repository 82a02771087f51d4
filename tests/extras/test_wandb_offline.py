"""Metrics mirrored to Weights & Biases in offline mode (`[wandb] enabled`): a demo run's
shipped batches as `train/...` and its evals as `eval/...`, read back from the run's
offline log; a resumed run continues the same W&B run.

Runs only in `make test-extras` (tests/extras/run.sh), which installs the extras and sets
`ORCH_TEST_EXTRAS`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import trio
from demo_run import DEMO_CONFIG, demo_paths
from wandb.proto import wandb_internal_pb2

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config


def history(log: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run's `.wandb` log.

    wandb 0.31 writes it from its Go core and has no Python reader any more: a 7-byte
    header (":W&B", magic, version), then LevelDB-log records in 32 KiB blocks (crc, length,
    type: full, first, middle, last), each record a protobuf `Record`."""
    data, pos, rows, pending = log.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if length == 0 and kind == 0:
            pos += left  # the block's zero padding
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def config(run_dir: Path, steps: int) -> Config:
    return load_config(
        DEMO_CONFIG,
        [
            *demo_paths(run_dir),
            "eval.num_examples=8",
            f"max_steps={steps}",
            "wandb.enabled=true",
            "sim.train_time_s=0.05",
            "trainer.poll_interval_s=0.1",
        ],
    )


async def test_batches_and_evals_reach_an_offline_wandb_run_and_a_resume_continues_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    with trio.fail_after(180):
        await launch_run(config(run_dir, 3))
    (first,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = history(first)
    train = [row for row in rows if "train/step" in row]
    evals = [row for row in rows if "eval/version" in row]
    assert [row["train/step"] for row in train] == [1, 2, 3]
    assert all("train/reward_mean" in row and "train/reward/arith" in row for row in train)
    assert all(row["train/samples"] == 16 for row in train)
    assert [row["eval/version"] for row in evals] == [0, 3]
    assert all({"eval/arith-eval/reward_mean", "eval/arith-eval/pass@4"} <= set(r) for r in evals)
    # The mirror matches the run's own record.
    lines = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [row["train/reward_mean"] for row in train] == [line["reward_mean"] for line in lines]

    with trio.fail_after(180):
        await launch_run(config(run_dir, 5))
    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and len({log.name for log in logs}) == 1  # one W&B run id
    second = next(log for log in logs if log != first)
    assert [row["train/step"] for row in history(second) if "train/step" in row] == [4, 5]
