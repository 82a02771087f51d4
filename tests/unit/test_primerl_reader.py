"""The local trainer's check of a prime-rl step (`read_primerl_step`): a step the daemon
ships passes; each broken rule is found and named, never raised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from sample_kit import by_handle_sample

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff.primerl import (
    MANIFEST_FILE,
    MicroBatch,
    RoutedExperts,
    decode_rank_file,
    publish_primerl_step,
    ranks_ready,
    read_primerl_step,
)

LAYERS, TOP_K = 2, 2


def sample(root: Path, index: int, length: int) -> TrainSample:
    rng = np.random.default_rng(index)
    routing = rng.integers(0, 8, size=(length - 1, LAYERS, TOP_K)).astype(np.uint8)
    return by_handle_sample(
        root / "v0",
        [{"routed_experts": (routing, 0)}],
        length,
        prompt=2,
        logprob=-1.0,
        rollout_id=f"r{index}",
        token_ids=rng.integers(0, 1000, size=length),
        server="http://s:1",
    )


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    samples = [sample(tmp_path / "payloads", i, n) for i, n in enumerate([30, 22, 18, 9, 7])]
    shipped = publish_primerl_step(
        tmp_path / "rollouts",
        1,
        samples,
        data_world_size=2,
        seq_len=32,
        env_name="math",
        fsync=False,
    )
    return shipped.path


def rewrite(step_dir: Path, rank: int, edit: Any) -> None:
    """Decode rank `rank`, let `edit` change its micro batches, encode it back."""
    path = step_dir / f"rank_{rank}.bin"
    micro_batches = decode_rank_file(path.read_bytes())
    edited = edit(micro_batches)
    path.write_bytes(msgspec.msgpack.encode(micro_batches if edited is None else edited))


def kinds(step_dir: Path) -> list[str]:
    return [p.kind for p in read_primerl_step(step_dir, 1, 2).problems]


def test_a_shipped_step_reads_without_problems(step_dir: Path) -> None:
    assert ranks_ready(2, step_dir) and not ranks_ready(3, step_dir)
    read = read_primerl_step(step_dir, 1, 2)
    assert read.problems == ()
    assert read.samples == 5
    assert read.dropped == ()
    # Only micro batches that are not padding count: 5 samples of [n, 2, 2] uint8 rows.
    assert read.payload_bytes == (30 + 22 + 18 + 9 + 7) * LAYERS * TOP_K


def test_routing_rows_that_differ_from_the_payload_files_are_found(step_dir: Path) -> None:
    def flip(micro_batches: list[MicroBatch]) -> None:
        routed = micro_batches[0].routed_experts
        assert routed is not None
        data = bytearray(routed.data)
        data[-1] ^= 0x01
        micro_batches[0].routed_experts = RoutedExperts(bytes(data), routed.shape, routed.dtype)

    rewrite(step_dir, 0, flip)
    [problem] = read_primerl_step(step_dir, 1, 2).problems
    assert problem.kind == "routing_mismatch"
    assert problem.file == str(step_dir / "rank_0.bin")


def test_positions_that_do_not_restart_at_zero_are_found(step_dir: Path) -> None:
    def positions(micro_batches: list[MicroBatch]) -> None:
        micro_batches[0].position_ids = [p + 1 for p in micro_batches[0].position_ids]

    rewrite(step_dir, 1, positions)
    assert kinds(step_dir) == ["bad_micro_batch"]


def test_a_short_per_token_list_is_found(step_dir: Path) -> None:
    def short(micro_batches: list[MicroBatch]) -> None:
        micro_batches[0].temperatures = micro_batches[0].temperatures[:-1]

    rewrite(step_dir, 0, short)
    assert kinds(step_dir) == ["bad_micro_batch"]


def test_ranks_with_different_micro_batch_counts_are_found(step_dir: Path) -> None:
    rewrite(step_dir, 1, lambda micro_batches: micro_batches[:-1])
    assert "bad_micro_batch" in kinds(step_dir)


def test_routing_whose_shape_does_not_match_the_tokens_is_found(step_dir: Path) -> None:
    def shape(micro_batches: list[MicroBatch]) -> None:
        routed = micro_batches[0].routed_experts
        assert routed is not None
        micro_batches[0].routed_experts = RoutedExperts(
            routed.data, [routed.shape[0] + 1, *routed.shape[1:]], routed.dtype
        )

    rewrite(step_dir, 0, shape)
    assert kinds(step_dir) == ["bad_micro_batch"]


def test_a_rank_file_that_is_not_msgpack_micro_batches_is_a_bad_batch(step_dir: Path) -> None:
    (step_dir / "rank_1.bin").write_bytes(b"\x92\x01")
    assert kinds(step_dir) == ["bad_batch"]


def test_a_missing_manifest_is_a_bad_batch_and_the_ranks_are_still_checked(
    step_dir: Path,
) -> None:
    (step_dir / MANIFEST_FILE).unlink()
    read = read_primerl_step(step_dir, 1, 2)
    assert [p.kind for p in read.problems] == ["bad_batch"]
    assert read.samples >= 5  # padding cannot be told apart without the manifest


def test_a_payload_file_gone_before_the_trainer_read_is_payload_missing(
    step_dir: Path, tmp_path: Path
) -> None:
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    sequence = manifest["ranks"][0]["micro_batches"][0]["sequences"][0]
    (Path(sequence["payload_dir"]) / sequence["routed_experts"][0]["file"]).unlink()
    assert "payload_missing" in kinds(step_dir)
