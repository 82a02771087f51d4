"""The run's state from disk for `status` and `gc`: bounds, the daemon lock probe, the
snapshot reader, the shallow root listing, and the shared formatting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from payload_gc import EntryKind, PayloadGCError, RootMissing, RootRefused
from sample_kit import train_sample

from orchestrator.commands.inspect import (
    RunMissing,
    format_as_of,
    format_table,
    format_version,
    human_bytes,
    list_payload_root,
    probe_daemon_lock,
    read_run_on_disk,
)
from orchestrator.config import Config, SimConfig, StalenessConfig
from orchestrator.core.staleness import Staleness
from orchestrator.errors import UserError
from orchestrator.handoff import (
    LOCK_FILE,
    Progress,
    hold_run_lock,
    publish_batch,
    publish_weights,
    save_progress,
)

# -- bounds (docs/design.md §3) -----------------------------------------------------------------


def test_design_test_vector() -> None:
    # m = 2, v0..v11 on disk, s = 10 applied: keep v8..v11, delete v0..v7.
    assert Staleness(2).collection_bound(10) == 8
    # The next collection comes after v11 is applied.
    assert Staleness(2).collection_bound(10 + 1) == 9


@pytest.mark.parametrize(
    ("applied", "m", "now", "after"),
    [(0, 0, 0, 1), (0, 2, -2, -1), (3, 1, 2, 3), (7, 7, 0, 1)],
)
def test_bounds_early_in_a_run_may_be_negative(applied: int, m: int, now: int, after: int) -> None:
    staleness = Staleness(m, max_async_steps=0)
    assert staleness.collection_bound(applied) == now
    assert staleness.collection_bound(applied + 1) == after


def test_negative_max_off_policy_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        Staleness(-1, max_async_steps=0)


# -- formatting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 * 1024**3, "5.0 GiB"),
        (3 * 1024**6, "3072.0 PiB"),
    ],
)
def test_human_bytes(size: int, text: str) -> None:
    assert human_bytes(size) == text


def test_format_version() -> None:
    assert (format_version(8), format_version(0), format_version(-2)) == ("v8", "v0", "-2")


def test_format_as_of() -> None:
    at = 1_764_400_000.0  # 2025-11-29 07:06:40 UTC
    assert format_as_of(at, at + 12) == "2025-11-29 07:06:40 UTC, 12 s ago"
    assert format_as_of(at, at + 90) == "2025-11-29 07:06:40 UTC, 1.5 min ago"
    assert format_as_of(at, at + 7200) == "2025-11-29 07:06:40 UTC, 2.0 h ago"
    assert format_as_of(at, at + 3 * 86400) == "2025-11-29 07:06:40 UTC, 3.0 d ago"
    assert format_as_of(at, at - 5) == "2025-11-29 07:06:40 UTC, 5 s in the future"
    assert format_as_of(0.0, at) == "an unknown time"


def test_format_table_aligns_columns() -> None:
    lines = format_table(
        ("entry", "files", "note"),
        [("v2", "3", "keep"), ("v10", "12345", "")],
        numeric={1},
    )
    assert lines == [
        "  entry  files  note",
        "  v2         3  keep",
        "  v10    12345",
    ]


def test_format_table_refuses_ragged_rows() -> None:
    with pytest.raises(ValueError, match="3 cells"):
        format_table(("a", "b", "c"), [("x", "y")], numeric=())


# -- the daemon lock --------------------------------------------------------------------


def test_no_lock_file_means_no_daemon_and_creates_nothing(tmp_path: Path) -> None:
    lock = probe_daemon_lock(tmp_path / "orchestrator")
    assert (lock.running, lock.holder) == (False, None)
    assert not (tmp_path / "orchestrator").exists()


def test_a_held_lock_is_seen_and_left_held(tmp_path: Path) -> None:
    with hold_run_lock(tmp_path):
        lock = probe_daemon_lock(tmp_path)
        assert lock.running is True
        assert lock.holder is not None
        assert lock.holder.startswith("host=")
        assert f"pid={os.getpid()}" in lock.holder
        # Probing did not take the lock from its holder: a second daemon is still refused.
        with (
            pytest.raises(UserError, match="another orchestrator is running"),
            hold_run_lock(tmp_path),
        ):
            pass
        assert probe_daemon_lock(tmp_path).running is True


def test_a_released_lock_shows_the_last_holder_and_stays_free(tmp_path: Path) -> None:
    with hold_run_lock(tmp_path):
        pass
    lock = probe_daemon_lock(tmp_path)
    assert lock.running is False
    assert lock.holder is not None
    assert f"pid={os.getpid()}" in lock.holder
    # The probe released its shared lock: a daemon can start.
    with hold_run_lock(tmp_path):
        assert probe_daemon_lock(tmp_path).running is True


def test_an_unopenable_lock_file_is_unknown(tmp_path: Path) -> None:
    # A link is refused (O_NOFOLLOW) rather than followed somewhere else.
    (tmp_path / "elsewhere").write_text("x")
    (tmp_path / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    assert probe_daemon_lock(tmp_path).running is None


# -- the snapshot -----------------------------------------------------------------------


def _config(run_dir: Path, m: int = 2) -> Config:
    return Config(
        run_dir=run_dir,
        sim=SimConfig(inference_servers=1),
        staleness=StalenessConfig(max_off_policy_steps=m, max_async_steps=1),
    )


def test_missing_run_dir(tmp_path: Path) -> None:
    with pytest.raises(
        RunMissing, match=r"run directory .*/nope does not exist \(run_dir in x.toml\)"
    ):
        read_run_on_disk(_config(tmp_path / "nope"), source="x.toml")


def test_empty_run(tmp_path: Path) -> None:
    snapshot = read_run_on_disk(_config(tmp_path))
    assert snapshot.shipped_step == 0
    assert snapshot.published_version == 0
    assert snapshot.progress is None
    assert snapshot.progress_problem == "missing"
    assert snapshot.daemon.running is False
    assert snapshot.payload_root == tmp_path / "payloads"
    assert snapshot.max_off_policy_steps == 2


def test_snapshot_reads_batches_weights_and_progress(tmp_path: Path) -> None:
    config = _config(tmp_path, m=3)
    for step in (1, 2, 3):
        publish_batch(config.batches_dir, step, [train_sample()], fsync=False)
    # A publish cut short leaves a temp dir: it is not a shipped batch.
    (config.batches_dir / ".tmp-step_000004-abcd").mkdir()
    publish_weights(config.weights_dir, 1, fsync=False)
    publish_weights(config.weights_dir, 2, fsync=False)
    (config.weights_dir / "step_000003").mkdir()  # no STABLE yet
    progress = Progress(step=2, applied_version=2, bound=0, updated_at=5.0)
    save_progress(config.state_dir, progress)
    snapshot = read_run_on_disk(config)
    assert (snapshot.shipped_step, snapshot.published_version) == (3, 2)
    assert snapshot.progress == progress
    assert snapshot.progress_problem is None
    assert snapshot.max_off_policy_steps == 3


def test_unreadable_progress_is_told_from_missing(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config.state_dir.mkdir()
    (config.state_dir / "progress.json").write_text(json.dumps({"step": 1}))
    snapshot = read_run_on_disk(config)
    assert (snapshot.progress, snapshot.progress_problem) == (None, "unreadable")


def test_unlistable_batches_dir_is_one_line(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config.batches_dir.write_text("not a directory")
    with pytest.raises(UserError, match=r"^cannot list the batches directory .*batches: "):
        read_run_on_disk(config)


# -- the shallow root listing -----------------------------------------------------------


def test_list_payload_root_enters_nothing(tmp_path: Path) -> None:
    for version in (0, 1, 5):
        (tmp_path / f"v{version}").mkdir()
        (tmp_path / f"v{version}" / "a.bin").write_bytes(b"abc")
    (tmp_path / "v2").symlink_to(tmp_path / "v5")
    (tmp_path / "v3").write_text("a file named like a version")
    (tmp_path / ".payload-root").touch()
    plan = list_payload_root(tmp_path, 4)
    assert [(d.name, d.kind) for d in plan.delete] == [
        ("v0", EntryKind.DIRECTORY),
        ("v1", EntryKind.DIRECTORY),
        ("v2", EntryKind.SYMLINK),
    ]
    assert all(d.usage is None for d in plan.delete)
    assert [k.name for k in plan.keep] == ["v3", "v5", ".payload-root"]
    assert plan.marked
    assert plan.foreign == ("v3",)


def test_list_payload_root_refusals(tmp_path: Path) -> None:
    with pytest.raises(RootMissing, match="does not exist"):
        list_payload_root(tmp_path / "missing", 3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PayloadGCError, match="is not a directory"):
        list_payload_root(tmp_path / "file", 3)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(RootRefused, match="is a symbolic link"):
        list_payload_root(tmp_path / "link", 3)
