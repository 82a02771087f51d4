"""publish_primerl_step: a step is every rank file and the manifest, appearing at once;
routing read from the payload files (or taken inline) lands in the micro batches byte for
byte; a sample whose payload cannot be read is dropped alone; resuming counts only complete
steps."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import structlog
from sample_kit import by_handle_sample, train_sample

from orchestrator.core.environments import DEFAULT_TEMPERATURE
from orchestrator.core.rollouts import GroupResult, RolloutResult, Sample, TrainSample
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.startup import find_start_point
from orchestrator.errors import UserError
from orchestrator.handoff import (
    BatchExists,
    HandoffSettings,
    handoff_format,
    remove_partial_batches,
)
from orchestrator.handoff.primerl import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MicroBatch,
    NothingToShip,
    decode_rank_file,
    publish_primerl_step,
    shipped_primerl_steps,
    unfinished_primerl_steps,
)
from orchestrator.payload import (
    PayloadSegment,
    read_sample_payload,
)

LAYERS, TOP_K = 3, 2
SEQ_LEN = 64


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def by_handle(root: Path, index: int, length: int) -> TrainSample:
    """A sample of `length` tokens whose routing (two turns, uint8) is in payload files
    under `<root>/v0`, as a server writes them and the daemon stitches them."""
    rng = np.random.default_rng(index)
    split = length // 2
    first = rng.integers(0, 16, size=(split, LAYERS, TOP_K)).astype(np.uint8)
    second = rng.integers(0, 16, size=(length - 1 - split, LAYERS, TOP_K)).astype(np.uint8)
    turns = [{"routed_experts": (first, 0)}, {"routed_experts": (second, split)}]
    return by_handle_sample(root / "v0", turns, length, **_fields(index, length))


def inline(index: int, length: int, dtype: type = np.uint8) -> TrainSample:
    rng = np.random.default_rng(index)
    routing = rng.integers(0, 200, size=(length, LAYERS, TOP_K)).astype(dtype)
    return train_sample(inline={"routed_experts": routing}, **_fields(index, length))


def _fields(index: int, length: int) -> dict[str, Any]:
    """Sample `index`'s own fields: its tokens (seeded by it), groups of two samples, two
    servers, trained on from a third of its length."""
    rng = np.random.default_rng(1000 + index)
    return {
        "prompt": length // 3,
        "group_id": f"g{index // 2}",
        "rollout_id": f"r{index}",
        "advantage": 0.25 * (index + 1),
        "token_ids": rng.integers(0, 32000, size=length),
        "server": f"http://server-{index % 2}:8000",
    }


def publish(rollouts_dir: Path, samples: list[TrainSample], step: int = 1, ranks: int = 2) -> Any:
    return publish_primerl_step(
        rollouts_dir,
        step,
        samples,
        data_world_size=ranks,
        seq_len=SEQ_LEN,
        env_name="math",
        fsync=False,
    )


def manifest(step_dir: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((step_dir / MANIFEST_FILE).read_text())
    return document


def ranks(step_dir: Path, count: int) -> list[list[MicroBatch]]:
    return [decode_rank_file((step_dir / f"rank_{r}.bin").read_bytes()) for r in range(count)]


def sequences(step_dir: Path, count: int) -> list[tuple[MicroBatch, int, dict[str, Any], bool]]:
    """Every packed sequence: its micro batch, its first position, its manifest entry and
    whether its micro batch is padding."""
    found = []
    document = manifest(step_dir)
    for rank, micro_batches in enumerate(ranks(step_dir, count)):
        for batch, entry in zip(
            micro_batches, document["ranks"][rank]["micro_batches"], strict=True
        ):
            start = 0
            for sequence in entry["sequences"]:
                found.append((batch, start, sequence, entry["padding"]))
                start += sequence["length"]
    return found


def routing_rows(batch: MicroBatch) -> np.ndarray:
    routed = batch.routed_experts
    assert routed is not None
    dtype = np.dtype(routed.dtype).newbyteorder("<")
    return np.frombuffer(routed.data, dtype=dtype).reshape(routed.shape)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "payloads"


def test_a_step_is_every_rank_file_and_the_manifest(tmp_path: Path, root: Path) -> None:
    rollouts = tmp_path / "prime-rl" / "rollouts"
    samples = [by_handle(root, i, length) for i, length in enumerate([40, 30, 25, 20, 12, 9])]
    shipped = publish(rollouts, samples, step=7)
    assert shipped.path == rollouts / "step_7"
    assert names(rollouts) == ["step_7"]  # no temp directory left
    assert names(shipped.path) == [MANIFEST_FILE, "rank_0.bin", "rank_1.bin"]
    decoded = ranks(shipped.path, 2)
    assert len(decoded[0]) == len(decoded[1]) == shipped.micro_batches
    assert shipped.samples == 6 and shipped.dropped == ()
    assert shipped.tokens == sum(len(b.input_ids) for r in decoded for b in r)
    document = manifest(shipped.path)
    assert document["format"] == MANIFEST_FORMAT
    assert (document["step"], document["data_world_size"], document["seq_len"]) == (7, 2, SEQ_LEN)
    assert (document["samples"], document["env_name"], document["dropped"]) == (6, "math", [])
    for rank, entry in enumerate(document["ranks"]):
        assert entry["file"] == f"rank_{rank}.bin"
        assert entry["bytes"] == (shipped.path / entry["file"]).stat().st_size
    assert shipped_primerl_steps(rollouts, 2) == [7]
    assert handoff_format("prime-rl").shipped_steps(
        HandoffSettings(rollouts, data_world_size=2)
    ) == [7]


def test_each_sequence_carries_its_samples_arrays(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, length) for i, length in enumerate([40, 30, 25, 20, 12, 9])]
    step_dir = publish(tmp_path, samples).path
    by_rollout = {s.rollout_id: s for s in samples}
    seen = set()
    for batch, start, entry, padding in sequences(step_dir, 2):
        sample = by_rollout[entry["rollout_id"]]
        window = slice(start, start + entry["length"])
        assert entry["length"] == len(sample.token_ids)
        assert (entry["group_id"], entry["server"]) == (sample.group_id, sample.server)
        assert batch.input_ids[window] == sample.token_ids.tolist()
        assert batch.position_ids[window] == list(range(entry["length"]))
        assert batch.temperatures[window] == [DEFAULT_TEMPERATURE] * entry["length"]
        assert batch.env_names[window] == ["math"] * entry["length"]
        assert np.allclose(batch.inference_logprobs[window], sample.logprobs)
        if padding:
            assert not any(batch.loss_mask[window]) and not any(batch.advantages[window])
            continue
        seen.add(sample.rollout_id)
        assert batch.loss_mask[window] == sample.loss_mask.tolist()
        expected = np.where(sample.loss_mask, np.float32(sample.advantage), 0.0)
        assert np.array_equal(np.asarray(batch.advantages[window], dtype=np.float32), expected)
    assert seen == set(by_rollout)


def test_routing_rows_by_handle_are_the_payload_files_bytes(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, length) for i, length in enumerate([50, 33, 31, 17, 8])]
    step_dir = publish(tmp_path, samples).path
    checked = 0
    for batch, start, entry, _ in sequences(step_dir, 2):
        assert entry["routing"] == "by_handle"
        segments = [PayloadSegment.from_json(s) for s in entry["routed_experts"]]
        expected = read_sample_payload(
            Path(entry["payload_dir"]), {"routed_experts": segments}, entry["length"], verify=True
        )["routed_experts"]
        rows = routing_rows(batch)[start : start + entry["length"]]
        assert rows.dtype == expected.dtype == np.uint8
        assert rows.tobytes() == expected.tobytes()
        checked += 1
    assert checked >= len(samples)


def test_inline_routing_is_the_samples_own_in_the_widest_dtype(tmp_path: Path) -> None:
    samples = [
        inline(0, 30),
        inline(1, 20, np.uint16),
        inline(2, 10),
        train_sample(**_fields(3, 12)),
    ]
    step_dir = publish(tmp_path, samples, ranks=1).path
    by_rollout = {s.rollout_id: s for s in samples}
    for batch, start, entry, _ in sequences(step_dir, 1):
        sample = by_rollout[entry["rollout_id"]]
        if sample.inline is None:
            # Without routing: never in a micro batch with routed samples.
            assert entry["routing"] == "none" and batch.routed_experts is None
            continue
        assert entry["routing"] == "inline" and "payload_dir" not in entry
        rows = routing_rows(batch)[start : start + entry["length"]]
        expected = sample.inline["routed_experts"]
        assert np.array_equal(rows, expected)


def test_a_broken_payload_drops_that_sample_only(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, 20 + i) for i in range(5)]
    # Sample 1's first file gets a flipped byte; sample 3's second file is deleted.
    corrupt = root / "v0" / samples[1].payload["routed_experts"][0].file
    data = bytearray(corrupt.read_bytes())
    data[3] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    missing = root / "v0" / samples[3].payload["routed_experts"][1].file
    missing.unlink()
    with structlog.testing.capture_logs() as logs:
        shipped = publish(tmp_path / "rollouts", samples)
    assert shipped.samples == 3
    assert [(d.index, d.rollout_id, d.reason) for d in shipped.dropped] == [
        (1, "r1", "payload_corrupt"),
        (3, "r3", "payload_missing"),
    ]
    assert [d.file for d in shipped.dropped] == [str(corrupt), str(missing)]
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [(w["rollout"], w["server"]) for w in warnings] == [
        ("r1", "http://server-1:8000"),
        ("r3", "http://server-1:8000"),
    ]
    shipped_ids = {entry["rollout_id"] for _, _, entry, _ in sequences(shipped.path, 2)}
    assert shipped_ids == {"r0", "r2", "r4"}
    dropped = manifest(shipped.path)["dropped"]
    assert [(d["rollout_id"], d["server"], d["reason"]) for d in dropped] == [
        ("r1", "http://server-1:8000", "payload_corrupt"),
        ("r3", "http://server-1:8000", "payload_missing"),
    ]


def test_when_no_payload_can_be_read_nothing_is_written(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, 16) for i in range(2)]
    for sample in samples:
        (root / "v0" / sample.payload["routed_experts"][0].file).unlink()
    rollouts = tmp_path / "rollouts"
    with pytest.raises(NothingToShip) as caught:
        publish(rollouts, samples)
    assert [d.rollout_id for d in caught.value.dropped] == ["r0", "r1"]
    assert names(rollouts) == []


def test_a_crash_before_the_rename_leaves_a_temp_dir_that_start_up_removes(
    tmp_path: Path, root: Path
) -> None:
    rollouts = tmp_path / "rollouts"
    samples = [by_handle(root, i, 20) for i in range(3)]
    publish(rollouts, samples, step=1)
    # Simulated crash: every file of step 2 is written, then the process dies before the
    # rename (os._exit would skip the cleanup; here the rename raises and it is skipped).
    with (
        mock.patch.object(Path, "rename", side_effect=KeyboardInterrupt),
        mock.patch("shutil.rmtree"),
        pytest.raises(KeyboardInterrupt),
    ):
        publish(rollouts, samples, step=2)
    leftover = [name for name in names(rollouts) if name != "step_1"]
    assert len(leftover) == 1 and leftover[0].startswith(".tmp-step_2-")
    assert names(rollouts / leftover[0]) == [MANIFEST_FILE, "rank_0.bin", "rank_1.bin"]
    # No rank file of step 2 is where a prime-rl rank waits for it.
    assert not (rollouts / "step_2").exists()
    assert shipped_primerl_steps(rollouts, 2) == [1]
    start = find_start_point(
        handoff_format("prime-rl"), HandoffSettings(rollouts, data_world_size=2), tmp_path / "state"
    )
    assert (start.resume_step, start.resumed) == (1, True)
    assert names(rollouts) == ["step_1"]
    assert publish(rollouts, samples, step=2).path == rollouts / "step_2"


def test_a_failed_write_leaves_nothing(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, 20) for i in range(3)]
    with (
        mock.patch("os.writev", side_effect=OSError(28, "No space left on device")),
        pytest.raises(OSError, match="No space"),
    ):
        publish(tmp_path / "rollouts", samples)
    assert names(tmp_path / "rollouts") == []


def test_a_shipped_step_is_never_rewritten(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, 20) for i in range(3)]
    step_dir = publish(tmp_path, samples, step=3).path
    before = {name: (step_dir / name).stat().st_ino for name in names(step_dir)}
    with pytest.raises(BatchExists):
        publish(tmp_path, samples, step=3)
    assert {name: (step_dir / name).stat().st_ino for name in names(step_dir)} == before
    # Anything else under the name blocks it too, and is left alone.
    (tmp_path / "step_4").mkdir()
    (tmp_path / "step_4" / "rank_0.bin").write_bytes(b"someone else's")
    with pytest.raises(BatchExists):
        publish(tmp_path, samples, step=4)
    assert names(tmp_path / "step_4") == ["rank_0.bin"]
    assert [n for n in names(tmp_path) if n.startswith(".tmp-")] == []
    # An empty directory is not a step: it is replaced.
    (tmp_path / "step_5").mkdir()
    publish(tmp_path, samples, step=5)
    assert shipped_primerl_steps(tmp_path, 2) == [3, 5]


def test_shipped_steps_are_the_complete_canonical_dirs(tmp_path: Path, root: Path) -> None:
    assert shipped_primerl_steps(tmp_path / "missing", 2) == []
    samples = [by_handle(root, i, 20) for i in range(3)]
    rollouts = tmp_path / "rollouts"
    for step in (1, 2, 3, 4):
        publish(rollouts, samples, step=step)
    (rollouts / "step_2" / "rank_1.bin").unlink()  # a rank missing
    (rollouts / "step_3" / MANIFEST_FILE).unlink()  # not ours
    (rollouts / "step_05").mkdir()  # not prime-rl's spelling
    (rollouts / "step_05" / MANIFEST_FILE).write_text("{}")
    (rollouts / "step_6").symlink_to(rollouts / "step_1")
    (rollouts / ".tmp-step_7-abcd").mkdir()
    (rollouts / "step_8").write_text("a file")
    assert shipped_primerl_steps(rollouts, 2) == [1, 4]
    assert shipped_primerl_steps(rollouts, 1) == [1, 2, 4]
    assert shipped_primerl_steps(rollouts, 3) == []
    assert unfinished_primerl_steps(rollouts, 2) == [2, 3]
    # A step cut short leaves `.tmp-*`, which start-up removes as for native batches.
    assert remove_partial_batches(rollouts) == 1


def test_start_up_refuses_steps_it_did_not_ship_for_these_ranks(tmp_path: Path, root: Path) -> None:
    samples = [by_handle(root, i, 20) for i in range(3)]
    rollouts = tmp_path / "rollouts"
    publish(rollouts, samples, step=1)
    # Resumed with another number of data ranks: step 1 lacks rank_2.bin and rank_3.bin.
    with pytest.raises(UserError, match="data_world_size = 4"):
        find_start_point(
            handoff_format("prime-rl"),
            HandoffSettings(rollouts, data_world_size=4),
            tmp_path / "state",
        )
    # Another orchestrator's step (rank files, no manifest).
    other = tmp_path / "other"
    (other / "step_1").mkdir(parents=True)
    (other / "step_1" / "rank_0.bin").write_bytes(b"\x90")
    with pytest.raises(UserError, match="step_1 is not a step this daemon shipped"):
        find_start_point(
            handoff_format("prime-rl"),
            HandoffSettings(other, data_world_size=1),
            tmp_path / "state",
        )
    # A fresh run: nothing shipped, no progress saved.
    fresh = find_start_point(
        handoff_format("prime-rl"),
        HandoffSettings(tmp_path / "new", data_world_size=2),
        tmp_path / "state",
    )
    assert (fresh.resume_step, fresh.resumed) == (0, False)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="from 1"):
        publish(tmp_path / "r", [inline(0, 10)], step=0)
    with pytest.raises(ValueError, match="at least one sample"):
        publish(tmp_path / "r", [])
    with pytest.raises(ValueError, match="over seq_len"):
        publish(tmp_path / "r", [inline(0, SEQ_LEN + 1)])
    assert not (tmp_path / "r").exists() or names(tmp_path / "r") == []


def test_unshipped_samples_count_as_untrainable_in_the_sink() -> None:
    sink = TrainSink(
        SinkLimits(
            batch_size=2,
            constant_size=True,
            staleness=Staleness(2),
            curriculum_min_mean_reward=0.0,
            curriculum_max_mean_reward=1.0,
            max_seq_len=16,
        )
    )
    members = tuple(
        RolloutResult(
            f"r{i}",
            0,
            reward=float(i),
            samples=(Sample(f"r{i}", range(6), (0, 0, 0, 1, 1, 1), (0.0,) * 6),),
        )
        for i in range(2)
    )
    sink.admit(GroupResult("g", 0, members), 1)
    samples, _ = sink.assemble(1)
    assert (len(samples), sink.shipped) == (2, 2)
    sink.unship(samples[:1])
    assert (sink.shipped, sink.counters["untrainable"]) == (1, 1)
    tally = sink.by_env[samples[0].env]
    assert (tally.shipped, tally.discards["untrainable"]) == (1, 1)
    # Every admitted unit is still accounted for exactly once.
    assert sink.admitted == sink.shipped + sink.queued_samples + sum(sink.counters.values())
    with pytest.raises(ValueError):
        sink.unship(samples + samples)
