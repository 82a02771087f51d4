"""Publishing batches atomically, listing shipped ones, cleaning up after a crash."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import trio

from orchestrator.handoff import (
    BATCH_FILE,
    BatchExists,
    TrainSample,
    batch_step_dir,
    decode_batch,
    is_complete_batch,
    publish_batch,
    publish_batch_async,
    remove_partial_batches,
    shipped_steps,
)


def names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def sample(reward: float = 1.0) -> TrainSample:
    return TrainSample(
        group_id="g",
        rollout_id="r",
        start_version=0,
        dispatch_version=0,
        reward=reward,
        advantage=0.0,
        token_ids=(1, 2),
        loss_mask=(0, 1),
        logprobs=(0.0, -0.5),
    )


def test_publish_creates_the_step_dir_with_batch_json(tmp_path: Path) -> None:
    batches_dir = tmp_path / "run" / "batches"
    batch_dir = publish_batch(batches_dir, 7, [sample()])
    assert batch_dir == batches_dir / "step_000007" == batch_step_dir(batches_dir, 7)
    assert names(batches_dir) == ["step_000007"]
    assert names(batch_dir) == [BATCH_FILE]
    document = decode_batch((batch_dir / BATCH_FILE).read_bytes(), source="x")
    assert document.step == 7
    assert document.samples == (sample(),)
    assert shipped_steps(batches_dir) == [7]
    assert is_complete_batch(batch_dir)


def test_wide_step_numbers_get_wider_names(tmp_path: Path) -> None:
    publish_batch(tmp_path, 1_234_567, [], fsync=False)
    assert names(tmp_path) == ["step_1234567"]
    assert shipped_steps(tmp_path) == [1_234_567]


def test_a_shipped_batch_is_never_rewritten(tmp_path: Path) -> None:
    first = publish_batch(tmp_path, 3, [sample(1.0)], fsync=False)
    before = (first / BATCH_FILE).read_bytes()
    with pytest.raises(BatchExists, match="already shipped") as caught:
        publish_batch(tmp_path, 3, [sample(0.0)], fsync=False)
    assert caught.value.filename == str(first)
    assert (first / BATCH_FILE).read_bytes() == before
    assert names(tmp_path) == ["step_000003"]


def test_losing_a_publish_race_raises_batch_exists_and_cleans_up(tmp_path: Path) -> None:
    # Another publisher ships the step between our existence check and our rename.
    real_rename = Path.rename

    def rename_after_rival(self: Path, target: Path) -> Path:
        rival = Path(target)
        rival.mkdir()
        (rival / BATCH_FILE).write_text("rival")
        return real_rename(self, target)

    with (
        mock.patch.object(Path, "rename", rename_after_rival),
        pytest.raises(BatchExists),
    ):
        publish_batch(tmp_path, 4, [sample()], fsync=False)
    assert names(tmp_path) == ["step_000004"]
    assert (tmp_path / "step_000004" / BATCH_FILE).read_text() == "rival"


def test_publish_refuses_step_zero_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="count from 1"):
        publish_batch(tmp_path, 0, [sample()])
    assert names(tmp_path) == []


def test_a_crash_mid_publish_leaves_no_visible_batch(tmp_path: Path) -> None:
    # Simulated crash: the temp dir is written in full, then the process dies before the
    # rename (os._exit would skip cleanup; here the rename raises and we keep the temp dir).
    with (
        mock.patch.object(Path, "rename", side_effect=KeyboardInterrupt),
        mock.patch("shutil.rmtree"),
        pytest.raises(KeyboardInterrupt),
    ):
        publish_batch(tmp_path, 5, [sample()])
    [leftover] = names(tmp_path)
    assert leftover.startswith(".tmp-step_000005-")
    assert (tmp_path / leftover / BATCH_FILE).is_file()
    assert shipped_steps(tmp_path) == []
    assert not is_complete_batch(tmp_path / "step_000005")
    # The step can still be shipped once the leftover is gone.
    assert remove_partial_batches(tmp_path) == 1
    assert names(tmp_path) == []
    publish_batch(tmp_path, 5, [sample()], fsync=False)
    assert shipped_steps(tmp_path) == [5]


def test_a_failed_write_removes_the_temp_dir(tmp_path: Path) -> None:
    with (
        mock.patch("orchestrator.handoff.store.write_file_synced", side_effect=OSError(28, "full")),
        pytest.raises(OSError, match="full"),
    ):
        publish_batch(tmp_path, 6, [sample()])
    assert names(tmp_path) == []


def test_shipped_steps_ignores_everything_but_complete_batch_dirs(tmp_path: Path) -> None:
    assert shipped_steps(tmp_path / "missing") == []
    for step in (12, 2, 9):
        publish_batch(tmp_path, step, [], fsync=False)
    (tmp_path / ".tmp-step_000013-abcd").mkdir()
    (tmp_path / ".tmp-step_000013-abcd" / BATCH_FILE).write_text("{}")
    (tmp_path / "step_000014").mkdir()  # no batch.json
    (tmp_path / "step_15").mkdir()  # not canonical
    (tmp_path / "step_15" / BATCH_FILE).write_text("{}")
    (tmp_path / "step_000016").write_text("a file")
    (tmp_path / "step_000017").symlink_to(tmp_path / "step_000012")
    (tmp_path / "step_000018" / BATCH_FILE).mkdir(parents=True)
    assert shipped_steps(tmp_path) == [2, 9, 12]
    assert not is_complete_batch(tmp_path / "step_000017")


def test_remove_partial_batches_only_touches_temp_entries(tmp_path: Path) -> None:
    assert remove_partial_batches(tmp_path / "missing") == 0
    publish_batch(tmp_path, 1, [], fsync=False)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (tmp_path / ".tmp-step_000002-aa").mkdir()
    (tmp_path / ".tmp-step_000002-aa" / BATCH_FILE).write_text("{}")
    (tmp_path / ".tmp-step_000003-bb").write_text("")
    (tmp_path / ".tmp-step_000004-cc").symlink_to(outside)
    (tmp_path / "notes.txt").write_text("")
    assert remove_partial_batches(tmp_path) == 3
    assert names(tmp_path) == ["notes.txt", "step_000001"]
    assert (outside / "keep.txt").read_text() == "keep"


async def test_publish_batch_async_runs_in_a_thread(tmp_path: Path) -> None:
    limiter = trio.CapacityLimiter(1)
    batch_dir = await publish_batch_async(tmp_path, 2, [sample()], fsync=False, limiter=limiter)
    assert json.loads((batch_dir / BATCH_FILE).read_text())["step"] == 2
    with pytest.raises(BatchExists):
        await publish_batch_async(tmp_path, 2, [sample()])


def test_an_empty_dir_at_the_final_name_is_not_a_shipped_batch(tmp_path: Path) -> None:
    (tmp_path / "step_000008").mkdir()
    assert shipped_steps(tmp_path) == []
    publish_batch(tmp_path, 8, [sample()], fsync=False)
    assert shipped_steps(tmp_path) == [8]
    # Junk that is not a batch still blocks the name: nothing is overwritten.
    (tmp_path / "step_000009").mkdir()
    (tmp_path / "step_000009" / "notes.txt").write_text("keep")
    with pytest.raises(BatchExists):
        publish_batch(tmp_path, 9, [sample()], fsync=False)
    assert names(tmp_path / "step_000009") == ["notes.txt"]
    assert names(tmp_path) == ["step_000008", "step_000009"]
