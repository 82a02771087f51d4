"""Deleting and measuring a version directory: vanished entries, other mounts, deep trees,
problems reported and the rest deleted.

Most go through a collection (`collect_below_sync`) or a plan (`plan_root`). Three check
the walk's mount check (payload_gc/_tree.py) with a mount identity that is not the root's,
which no real directory has without mounting one (the bind-mount tests need root), and
how often it is made, which no public call shows.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import payload_gc._tree as tree
import pytest
from payload_gc import CollectionError, DeletedDir, Usage, collect_below_sync, plan_root
from payload_gc._mounts import fd_mount_id
from payload_gc._tree import Tally, measure_dir, remove_tree
from payload_trees import refuse_listing


def test_a_version_removed_meanwhile_counts_as_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "f").write_bytes(b"abc")
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> int:
        # Another remover takes v1 away just before the collector opens it.
        if path == "v1" and dir_fd is not None and (tmp_path / "v1").exists():
            shutil.rmtree(tmp_path / "v1")
        return real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    report = collect_below_sync(tmp_path, 2)
    assert (report.outcome, report.errors) == ("complete", ())
    assert report.deleted == (DeletedDir("v1", 1, files=0, bytes=0),)


def test_another_mount_is_left_in_place_and_reported(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "f").write_bytes(b"abc")
    tally = Tally()
    # A mount identity that is not the root's: as if v1 were a mount point.
    kind, number = fd_mount_id(root_fd)
    assert not remove_tree(root_fd, "v1", "v1", (kind, number + 1), tally)
    assert tally.problems == ["v1: mount point (not entered), left in place"]
    assert (tmp_path / "v1" / "f").read_bytes() == b"abc"


def test_measure_counts_files_links_and_bytes_without_following(tmp_path: Path) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "a").write_bytes(b"12345")
    (tmp_path / "v1" / "d" / "b").write_bytes(b"12")
    (tmp_path / "v1" / "link").symlink_to(tmp_path / "v1" / "a")
    (planned,) = plan_root(tmp_path, 2).delete
    assert planned.usage == Usage(files=3, bytes=7)


def test_measure_does_not_enter_another_mount(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "d" / "b").write_bytes(b"12")
    (tmp_path / "v1" / "a").write_bytes(b"345")
    # Neither the top directory nor anything below it is measured on another mount.
    kind, number = fd_mount_id(root_fd)
    usage = measure_dir(root_fd, "v1", (kind, number + 1))
    assert (usage.files, usage.bytes) == (0, 0)


def test_problem_list_is_capped_but_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1").mkdir()
    for i in range(25):
        (tmp_path / "v1" / f"{i}.bin").write_bytes(b"x")
    real_unlink = os.unlink

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # Tests run as root too, where chmod cannot provoke EACCES: inject it instead.
        if path.endswith(".bin"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    (error,) = collect_below_sync(tmp_path, 2).errors
    assert error.name == "v1"
    assert error.message.count("Permission denied") == 20
    assert error.message.endswith("; and 5 more")


def test_deep_tree_needs_no_recursion(tmp_path: Path) -> None:
    # Deeper than the default recursion limit would allow for a recursive walk.
    path = tmp_path / "v1"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1200):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)
    report = collect_below_sync(tmp_path, 2)
    assert (report.outcome, report.deleted) == ("complete", (DeletedDir("v1", 1, 1, 0),))
    assert not (tmp_path / "v1").exists()


def test_an_unreadable_subdirectory_is_reported_once_and_the_rest_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1" / "locked").mkdir(parents=True)
    (tmp_path / "v1" / "locked" / "x").write_bytes(b"x")
    (tmp_path / "v1" / "free").write_bytes(b"y")
    refuse_listing(monkeypatch, tmp_path / "v1" / "locked")
    report = collect_below_sync(tmp_path, 2)
    assert report.errors == (CollectionError("v1", "v1/locked: Permission denied"),)
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["locked"]
    assert (tmp_path / "v1" / "locked" / "x").exists()
    assert report.files == 1


def test_the_mount_check_is_once_per_directory_never_per_file(
    tmp_path: Path, root_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1" / "a" / "b").mkdir(parents=True)
    (tmp_path / "v1" / "c").mkdir()
    for directory in ("v1", "v1/a", "v1/a/b", "v1/c"):
        for i in range(30):
            (tmp_path / directory / f"{i}.bin").write_bytes(b"x")
    checked: list[int] = []

    def counting(fd: int) -> tuple[str, int]:
        checked.append(fd)
        return fd_mount_id(fd)

    monkeypatch.setattr(tree, "fd_mount_id", counting)
    root_mount = fd_mount_id(root_fd)
    assert measure_dir(root_fd, "v1", root_mount).files == 120
    assert len(checked) == 4
    checked.clear()
    tally = Tally()
    assert remove_tree(root_fd, "v1", "v1", root_mount, tally)
    assert (tally.files, tally.problem_count) == (120, 0)
    assert len(checked) == 4
