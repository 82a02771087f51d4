"""Busy files (deleted while open, silly-renamed by NFS or FUSE) in the fd-relative walk:
never unlinked, never counted as files, and the directories holding them left as busy
rather than failed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from payload_gc import (
    EntryKind,
    KeepReason,
    RootEntry,
    is_busy_name,
    plan_collection,
    unmarked_root_refusal,
)
from payload_gc._mounts import fd_mount_id
from payload_gc._tree import MAX_PROBLEMS_KEPT, Tally, measure_dir, remove_tree

NFS = ".nfs000000000123abcd00000001"
FUSE = ".fuse_hidden0000000a00000001"


@pytest.mark.parametrize(
    "name",
    [NFS, FUSE, ".nfs0000abcd", ".nfsDEADBEEF00000002", ".fuse_hidden00000001"],
)
def test_silly_renamed_names_are_busy(name: str) -> None:
    assert is_busy_name(name)


@pytest.mark.parametrize(
    "name",
    [
        ".nfs",
        ".nfs1234567",  # too short for any client's counter
        ".nfsfoo00000000",
        "nfs000000000123abcd00000001",
        f"x{NFS}",
        f"{NFS}.bin",
        ".fuse_hidden",
        ".fuse_hiddenxyz00000000",
        "a.bin",
        ".payload-gc",
    ],
)
def test_other_names_are_not_busy(name: str) -> None:
    assert not is_busy_name(name)


def test_a_directory_holding_only_busy_files_is_left_busy_not_failed(
    tmp_path: Path, root_fd: int
) -> None:
    (tmp_path / "v1" / "sub").mkdir(parents=True)
    (tmp_path / "v1" / "a.bin").write_bytes(b"12345")
    (tmp_path / "v1" / NFS).write_bytes(b"held open by a reader")
    (tmp_path / "v1" / "sub" / "b.bin").write_bytes(b"12")
    (tmp_path / "v1" / "sub" / FUSE).write_bytes(b"also held")
    tally = Tally()
    assert not remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), tally)
    assert tally.problems == []
    assert tally.problem_count == 0
    # The busy files are neither deleted nor counted; everything else went.
    assert (tally.files, tally.bytes) == (2, 7)
    assert tally.busy_count == 2
    assert sorted(tally.busy_paths) == [f"v1/{NFS}", f"v1/sub/{FUSE}"]
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [NFS, "sub"]
    assert [p.name for p in (tmp_path / "v1" / "sub").iterdir()] == [FUSE]
    assert "2 busy files (" in tally.busy_summary()


def test_once_the_busy_files_are_gone_the_directory_goes(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / NFS).write_bytes(b"x")
    assert not remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), Tally())
    # The client removes the name when the file is closed.
    (tmp_path / "v1" / NFS).unlink()
    tally = Tally()
    assert remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), tally)
    assert (tally.files, tally.busy_count, tally.problem_count) == (0, 0, 0)
    assert not (tmp_path / "v1").exists()


def test_a_directory_with_a_busy_like_name_is_removed_as_usual(
    tmp_path: Path, root_fd: int
) -> None:
    # Only files are silly-renamed: a directory of that name is no busy file.
    (tmp_path / "v1" / NFS).mkdir(parents=True)
    (tmp_path / "v1" / NFS / "c.bin").write_bytes(b"abc")
    tally = Tally()
    assert remove_tree(root_fd, "v1", "v1", fd_mount_id(root_fd), tally)
    assert (tally.files, tally.bytes, tally.busy_count) == (1, 3, 0)
    assert not (tmp_path / "v1").exists()


def test_a_busy_file_next_to_a_real_failure_is_still_a_failure(
    tmp_path: Path, root_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import payload_gc._tree as tree

    (tmp_path / "v1" / "locked").mkdir(parents=True)
    (tmp_path / "v1" / "locked" / "x").write_bytes(b"x")
    (tmp_path / "v1" / NFS).write_bytes(b"y")
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
    assert tally.busy_paths == [f"v1/{NFS}"]


def test_measuring_counts_busy_files_apart(tmp_path: Path, root_fd: int) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "a").write_bytes(b"12345")
    (tmp_path / "v1" / NFS).write_bytes(b"123456789")
    (tmp_path / "v1" / "d" / FUSE).write_bytes(b"1")
    usage = measure_dir(root_fd, "v1", fd_mount_id(root_fd))
    assert (usage.files, usage.bytes, usage.busy) == (1, 5, 2)


def test_busy_paths_are_capped_but_counted() -> None:
    tally = Tally()
    for i in range(MAX_PROBLEMS_KEPT + 7):
        tally.busy(f"v1/.nfs{i:024x}")
    assert tally.busy_count == MAX_PROBLEMS_KEPT + 7
    assert len(tally.busy_paths) == MAX_PROBLEMS_KEPT
    assert " and 7 more" in tally.busy_summary()


def test_a_busy_file_in_the_root_stays_and_is_no_foreign_entry() -> None:
    entries = [
        RootEntry("v1", EntryKind.DIRECTORY),
        RootEntry(NFS, EntryKind.FILE),
        RootEntry(".payload-gc", EntryKind.DIRECTORY),
    ]
    plan = plan_collection(entries, 5)
    assert {k.name: k.reason for k in plan.keep} == {
        NFS: KeepReason.BUSY,
        ".payload-gc": KeepReason.CONTROL,
    }
    assert plan.foreign == ()
    # Neither a collection nor a wipe takes an unmarked root holding one for a stranger's.
    assert unmarked_root_refusal("/r", plan) is None
    wipe_plan = plan_collection([e for e in entries if e.name != "v1"], 0)
    assert unmarked_root_refusal("/r", wipe_plan, wipe=True) is None
    # A directory of that name is an ordinary foreign entry.
    odd = plan_collection([RootEntry(NFS, EntryKind.DIRECTORY)], 5)
    assert odd.foreign == (NFS,)
