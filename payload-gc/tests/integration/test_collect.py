"""Collecting a real payload root in tmp_path: what goes, what stays, the audit log."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import payload_gc._collect as _collect
import pytest
import trio
from payload_gc import (
    KeepReason,
    RootMissing,
    RootRefused,
    collect_below,
    collect_below_sync,
    min_fresh_version,
    plan_root,
)
from payload_trees import make_version


def _make_version(root: Path, version: int, files: int = 3, size: int = 100) -> None:
    make_version(root, version, files, size, byte=bytes([version % 256]))


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _audit(root: Path) -> list[dict[str, object]]:
    lines = (root / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_design_test_vector_on_disk(tmp_path: Path) -> None:
    for version in range(12):
        _make_version(tmp_path, version)
    report = collect_below_sync(tmp_path, min_fresh_version(11, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".payload-gc",
        "v10",
        "v11",
        "v8",
        "v9",
    ]
    assert [d.name for d in report.deleted] == [f"v{k}" for k in range(8)]
    assert (report.dirs, report.files, report.bytes) == (8, 24, 2400)
    assert report.outcome == "complete"
    assert report.errors == ()
    kept = {k.name: k.reason for k in report.kept}
    assert kept["v8"] is KeepReason.AT_OR_ABOVE_BOUND
    assert kept[".payload-gc"] is KeepReason.CONTROL
    # Files of kept versions are untouched.
    assert (tmp_path / "v8" / "0.bin").read_bytes() == bytes([8]) * 100


def test_audit_line_per_collection(tmp_path: Path) -> None:
    for version in range(4):
        _make_version(tmp_path, version, files=2, size=10)
    collect_below_sync(tmp_path, 2)
    collect_below_sync(tmp_path, 2)  # nothing left below 2: still audited
    first, second = _audit(tmp_path)
    assert first["action"] == "collect"
    assert first["root"] == str(tmp_path)
    assert (first["bound"], first["dirs"], first["files"], first["bytes"]) == (2, 2, 4, 40)
    assert first["deleted"] == ["v0", "v1"]
    assert first["outcome"] == "complete"
    assert isinstance(first["duration_s"], float)
    assert isinstance(first["time"], str)
    assert str(first["time"]).endswith("+00:00")
    assert "errors" not in first
    assert (second["dirs"], second["files"]) == (0, 0)
    # The lock is released after each collection.
    assert not (tmp_path / ".payload-gc" / "lock").exists()


def test_nested_directories_and_empty_versions(tmp_path: Path) -> None:
    deep = tmp_path / "v1" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x").write_bytes(b"12345")
    (tmp_path / "v1" / "top").write_bytes(b"1")
    (tmp_path / "v2").mkdir()
    report = collect_below_sync(tmp_path, 3)
    assert [(d.name, d.files, d.bytes) for d in report.deleted] == [("v1", 2, 6), ("v2", 0, 0)]
    assert not (tmp_path / "v1").exists()


def test_files_named_like_versions_and_other_entries_stay(tmp_path: Path) -> None:
    _make_version(tmp_path, 1)
    (tmp_path / "v2").write_bytes(b"a file, not a version directory")
    (tmp_path / "vx").mkdir()
    (tmp_path / "v007").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    report = collect_below_sync(tmp_path, 100)
    assert [d.name for d in report.deleted] == ["v1"]
    assert (tmp_path / "v2").read_bytes() == b"a file, not a version directory"
    assert (tmp_path / "vx").is_dir()
    assert (tmp_path / "v007").is_dir()
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    kept = {k.name: k.reason for k in report.kept}
    assert kept["v2"] is KeepReason.NOT_A_DIRECTORY
    assert kept["v007"] is KeepReason.NOT_CANONICAL


def test_negative_bound_deletes_nothing(tmp_path: Path) -> None:
    _make_version(tmp_path, 0)
    report = collect_below_sync(tmp_path, min_fresh_version(1, 3))
    assert report.deleted == ()
    assert (tmp_path / "v0" / "0.bin").exists()


def test_a_recreated_directory_goes_in_the_next_collection(tmp_path: Path) -> None:
    _make_version(tmp_path, 3)
    collect_below_sync(tmp_path, 5)
    assert not (tmp_path / "v3").exists()
    # A still-running stale rollout writes into v3 again.
    _make_version(tmp_path, 3, files=1)
    report = collect_below_sync(tmp_path, 5)
    assert [(d.name, d.files) for d in report.deleted] == [("v3", 1)]
    assert not (tmp_path / "v3").exists()


def test_plan_root_matches_what_the_collection_deletes(tmp_path: Path) -> None:
    for version in range(5):
        _make_version(tmp_path, version, files=version + 1, size=7)
    plan = plan_root(tmp_path, 3)
    planned = [(d.name, d.usage.files, d.usage.bytes) for d in plan.delete if d.usage]
    report = collect_below_sync(tmp_path, 3)
    assert planned == [(d.name, d.files, d.bytes) for d in report.deleted]
    assert planned == [("v0", 1, 7), ("v1", 2, 14), ("v2", 3, 21)]


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(RootMissing, match="does not exist"):
        collect_below_sync(tmp_path / "nope", 3)


def test_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RootRefused, match="not a directory"):
        collect_below_sync(tmp_path / "file", 3)


def test_bad_worker_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        collect_below_sync(tmp_path, 3, max_workers=0)


def test_a_per_directory_error_is_reported_and_the_rest_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for version in range(4):
        _make_version(tmp_path, version)
    (tmp_path / "v1" / "locked.bin").write_bytes(b"zz")
    real_unlink = os.unlink

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # Tests run as root too, where chmod cannot provoke EACCES: inject it instead.
        if path == "locked.bin":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    report = collect_below_sync(tmp_path, 3)
    assert report.outcome == "partial"
    assert [d.name for d in report.deleted] == ["v0", "v2"]
    assert [e.name for e in report.errors] == ["v1"]
    assert report.errors[0].message == "v1/locked.bin: Permission denied"
    # The other files of v1 went; only the locked one (and v1) remain.
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["locked.bin"]
    assert report.files == 3 + 3 + 3
    audit = _audit(tmp_path)[-1]
    assert audit["outcome"] == "partial"
    assert isinstance(audit["errors"], list)
    assert str(audit["errors"][0]).startswith("v1: ")


async def test_async_api_collects_the_same(tmp_path: Path) -> None:
    for version in range(6):
        _make_version(tmp_path, version)
    report = await collect_below(tmp_path, 4, max_workers=2)
    assert [d.name for d in report.deleted] == ["v0", "v1", "v2", "v3"]
    assert _names(tmp_path) == [".payload-gc", "v4", "v5"]
    assert _audit(tmp_path)[-1]["dirs"] == 4


async def test_async_cancelled_before_starting_touches_nothing(tmp_path: Path) -> None:
    for version in range(3):
        _make_version(tmp_path, version)
    with trio.CancelScope() as scope:
        scope.cancel()
        await collect_below(tmp_path, 3)
    assert _names(tmp_path) == ["v0", "v1", "v2"]


async def test_async_cancelled_midway_finishes_the_running_directory_and_audits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for version in range(4):
        _make_version(tmp_path, version)
    real_unlink = os.unlink
    scope = trio.CancelScope()
    cancelled = threading.Event()

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # The first payload file deleted cancels the collection from its worker thread;
        # that directory's deletion still runs to the end, and those not started yet stay.
        if path.endswith(".bin") and not cancelled.is_set():
            cancelled.set()
            trio.from_thread.run_sync(scope.cancel)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    with scope:
        await collect_below(tmp_path, 4, max_workers=1)
    assert scope.cancelled_caught
    remaining = [name for name in _names(tmp_path) if name.startswith("v")]
    assert len(remaining) == 3
    audit = _audit(tmp_path)[-1]
    assert audit["outcome"] == "interrupted"
    assert audit["dirs"] == 1
    assert audit["files"] == 3
    assert not (tmp_path / ".payload-gc" / "lock").exists()


def test_an_unexpected_os_error_fails_only_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The walk records every error it expects as a problem; this is the net under it, for
    # one it does not (e.g. running out of descriptors), raised from the walk itself: no
    # public call can make it raise.
    for version in range(3):
        _make_version(tmp_path, version)
    real_remove_tree = _collect.remove_tree

    def remove_tree(parent_fd: int, name: str, path: str, root_dev: int, tally: object) -> bool:
        if name == "v1":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_remove_tree(parent_fd, name, path, root_dev, tally)  # type: ignore[arg-type]

    monkeypatch.setattr(_collect, "remove_tree", remove_tree)
    report = collect_below_sync(tmp_path, 3)
    assert [d.name for d in report.deleted] == ["v0", "v2"]
    assert [(e.name, e.message) for e in report.errors] == [("v1", "v1: Too many open files")]
    assert report.outcome == "partial"
