"""Publishing batches atomically, listing shipped ones, cleaning up after a crash."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from sample_kit import train_sample

from orchestrator.handoff import (
    BATCH_FILE,
    NATIVE_FORMAT,
    BatchExists,
    HandoffSettings,
    batch_step_dir,
    is_complete_batch,
    publish_batch,
    read_batch_file,
    remove_partial_batches,
    shipped_steps,
)


def names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def test_publish_creates_the_step_dir_with_batch_bin(tmp_path: Path) -> None:
    batches_dir = tmp_path / "run" / "batches"
    batch_dir = publish_batch(batches_dir, 7, [train_sample()])
    assert batch_dir == batches_dir / "step_000007" == batch_step_dir(batches_dir, 7)
    assert names(batches_dir) == ["step_000007"]
    assert names(batch_dir) == [BATCH_FILE] == ["batch.bin"]
    batch = read_batch_file(batch_dir / BATCH_FILE)
    assert batch.step == 7
    assert [s.train_sample() for s in batch.samples] == [train_sample()]
    assert shipped_steps(batches_dir) == [7]
    assert is_complete_batch(batch_dir)


def test_wide_step_numbers_get_wider_names(tmp_path: Path) -> None:
    publish_batch(tmp_path, 1_234_567, [], fsync=False)
    assert names(tmp_path) == ["step_1234567"]
    assert shipped_steps(tmp_path) == [1_234_567]


def test_a_shipped_batch_is_never_rewritten(tmp_path: Path) -> None:
    first = publish_batch(tmp_path, 3, [train_sample(reward=1.0)], fsync=False)
    before = (first / BATCH_FILE).read_bytes()
    with pytest.raises(BatchExists, match="already shipped") as caught:
        publish_batch(tmp_path, 3, [train_sample(reward=0.0)], fsync=False)
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
        publish_batch(tmp_path, 4, [train_sample()], fsync=False)
    assert names(tmp_path) == ["step_000004"]
    assert (tmp_path / "step_000004" / BATCH_FILE).read_text() == "rival"


def test_publish_refuses_what_cannot_be_encoded_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="count from 1"):
        publish_batch(tmp_path, 0, [train_sample()])
    with pytest.raises(ValueError, match=r"samples\[1\]: reward must be finite"):
        publish_batch(tmp_path / "batches", 1, [train_sample(), train_sample(reward=float("nan"))])
    assert names(tmp_path) == []


def test_a_crash_mid_publish_leaves_no_visible_batch(tmp_path: Path) -> None:
    # Simulated crash: the temp dir is written in full, then the process dies before the
    # rename (os._exit would skip cleanup; here the rename raises and we keep the temp dir).
    with (
        mock.patch.object(Path, "rename", side_effect=KeyboardInterrupt),
        mock.patch("shutil.rmtree"),
        pytest.raises(KeyboardInterrupt),
    ):
        publish_batch(tmp_path, 5, [train_sample()])
    [leftover] = names(tmp_path)
    assert leftover.startswith(".tmp-step_000005-")
    assert (tmp_path / leftover / BATCH_FILE).is_file()
    assert shipped_steps(tmp_path) == []
    assert not is_complete_batch(tmp_path / "step_000005")
    # The step can still be shipped once the leftover is gone.
    assert remove_partial_batches(tmp_path) == 1
    assert names(tmp_path) == []
    publish_batch(tmp_path, 5, [train_sample()], fsync=False)
    assert shipped_steps(tmp_path) == [5]


def test_a_failed_write_removes_the_temp_dir(tmp_path: Path) -> None:
    with (
        mock.patch(
            "orchestrator.handoff.native.store.write_layout", side_effect=OSError(28, "full")
        ),
        pytest.raises(OSError, match="full"),
    ):
        publish_batch(tmp_path, 6, [train_sample()])
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


def test_an_empty_dir_at_the_final_name_is_not_a_shipped_batch(tmp_path: Path) -> None:
    (tmp_path / "step_000008").mkdir()
    assert shipped_steps(tmp_path) == []
    publish_batch(tmp_path, 8, [train_sample()], fsync=False)
    assert shipped_steps(tmp_path) == [8]
    # Junk that is not a batch still blocks the name: nothing is overwritten.
    (tmp_path / "step_000009").mkdir()
    (tmp_path / "step_000009" / "notes.txt").write_text("keep")
    with pytest.raises(BatchExists):
        publish_batch(tmp_path, 9, [train_sample()], fsync=False)
    assert names(tmp_path / "step_000009") == ["notes.txt"]
    assert names(tmp_path) == ["step_000008", "step_000009"]


def test_a_short_write_is_resumed(tmp_path: Path) -> None:
    # writev(2) may write less than asked (a signal, a full pipe, a quota): the writer
    # goes on from the byte it stopped at, across buffer boundaries.
    import os

    real_writev = os.writev
    calls: list[int] = []

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        whole = b"".join(bytes(b) for b in buffers)
        return real_writev(fd, [whole[: max(1, len(whole) // 3)]])

    samples = [train_sample(reward=float(i)) for i in range(40)]
    with mock.patch("time.time", return_value=1234.5):
        expected = publish_batch(tmp_path / "a", 1, samples, fsync=False)
        with mock.patch("os.writev", short_writev):
            got = publish_batch(tmp_path / "b", 1, samples, fsync=False)
    assert len(calls) > 3
    assert (got / BATCH_FILE).read_bytes() == (expected / BATCH_FILE).read_bytes()
    assert read_batch_file(got / BATCH_FILE).samples[39].reward == 39.0


def test_iovecs_are_chunked_under_iov_max(tmp_path: Path) -> None:
    import os

    real_writev = os.writev
    counts: list[int] = []

    def counting_writev(fd: int, buffers: list[memoryview]) -> int:
        counts.append(len(buffers))
        return real_writev(fd, buffers)

    # 4 columns of 600 samples each: 2,400 buffers and more.
    samples = [train_sample(reward=float(i)) for i in range(600)]
    with mock.patch("os.writev", counting_writev):
        batch_dir = publish_batch(tmp_path, 1, samples, fsync=False)
    assert max(counts) <= os.sysconf("SC_IOV_MAX") and sum(counts) > 2400
    assert len(read_batch_file(batch_dir / BATCH_FILE).samples) == 600


def test_a_run_with_batches_of_the_old_json_format_is_not_resumed(tmp_path: Path) -> None:
    from orchestrator.daemon.startup import find_start_point
    from orchestrator.errors import UserError

    batches_dir = tmp_path / "batches"
    publish_batch(batches_dir, 1, [train_sample()], fsync=False)
    assert (
        find_start_point(
            NATIVE_FORMAT, HandoffSettings(batches_dir), tmp_path / "state"
        ).resume_step
        == 1
    )
    (batches_dir / "step_000002").mkdir()
    (batches_dir / "step_000002" / "batch.json").write_text("{}")
    with pytest.raises(UserError, match=r"old JSON format 1 \(step 2: batch\.json\)"):
        find_start_point(NATIVE_FORMAT, HandoffSettings(batches_dir), tmp_path / "state")
