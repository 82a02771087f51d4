"""fd-relative deletion primitives: vanished entries, other mounts, measuring."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from payload_gc._mounts import fd_mount_id
from payload_gc._tree import Tally, measure_dir, remove_tree


def test_removing_what_is_already_gone_is_success(root_fd: int) -> None:
    tally = Tally()
    assert remove_tree(root_fd, "v9", "v9", fd_mount_id(root_fd), tally)
    assert (tally.files, tally.problem_count) == (0, 0)


def test_another_mount_is_left_in_place_and_reported(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "f").write_bytes(b"abc")
    tally = Tally()
    # A mount identity that is not the root's: as if v1 were a mount point.
    kind, number = fd_mount_id(root_fd)
    assert not remove_tree(root_fd, "v1", "v1", (kind, number + 1), tally)
    assert tally.problems == ["v1: mount point (not entered), left in place"]
    assert (tmp_path / "v1" / "f").read_bytes() == b"abc"


def test_measure_counts_files_links_and_bytes_without_following(
    tmp_path: Path, root_fd: int
) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "a").write_bytes(b"12345")
    (tmp_path / "v1" / "d" / "b").write_bytes(b"12")
    (tmp_path / "v1" / "link").symlink_to(tmp_path / "v1" / "a")
    usage = measure_dir(root_fd, "v1", fd_mount_id(root_fd))
    assert (usage.files, usage.bytes) == (3, 7)


def test_measure_does_not_enter_another_mount(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "d" / "b").write_bytes(b"12")
    (tmp_path / "v1" / "a").write_bytes(b"345")
    # Neither the top directory nor anything below it is measured on another mount.
    kind, number = fd_mount_id(root_fd)
    usage = measure_dir(root_fd, "v1", (kind, number + 1))
    assert (usage.files, usage.bytes) == (0, 0)


def test_problem_list_is_capped_but_counted() -> None:
    tally = Tally()
    for i in range(25):
        tally.problem(f"p{i}")
    assert tally.problem_count == 25
    assert len(tally.problems) == 20
    assert tally.summary().endswith("; and 5 more")


def test_deep_tree_needs_no_recursion(tmp_path: Path, root_fd: int) -> None:
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
    tally = Tally()
    assert remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), tally)
    assert tally.files == 1
    assert not (tmp_path / "v1").exists()


def test_an_unreadable_subdirectory_is_reported_once_and_the_rest_deleted(
    tmp_path: Path, root_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1" / "locked").mkdir(parents=True)
    (tmp_path / "v1" / "locked" / "x").write_bytes(b"x")
    (tmp_path / "v1" / "free").write_bytes(b"y")
    import payload_gc._tree as tree

    real_list_dir = tree.list_dir
    locked_ino = (tmp_path / "v1" / "locked").stat().st_ino

    def list_dir(fd: int) -> list[os.DirEntry[str]]:
        # Root bypasses permissions, so a listing refused by EACCES is injected.
        if os.fstat(fd).st_ino == locked_ino:
            raise PermissionError(13, "Permission denied")
        return real_list_dir(fd)

    monkeypatch.setattr(tree, "list_dir", list_dir)
    tally = Tally()
    assert not remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), tally)
    assert tally.problems == ["v1/locked: Permission denied"]
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == ["locked"]
    assert (tmp_path / "v1" / "locked" / "x").exists()
    assert tally.files == 1


def test_the_mount_check_is_once_per_directory_never_per_file(
    tmp_path: Path, root_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import payload_gc._tree as tree

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
