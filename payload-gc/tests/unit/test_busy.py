"""Busy files (deleted while open, silly-renamed by NFS or FUSE) in a collection: never
unlinked, never counted as files, and the directories holding them left as busy rather
than failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from payload_gc import (
    CollectionError,
    EntryKind,
    KeepReason,
    RootEntry,
    Usage,
    collect_below_sync,
    is_busy_name,
    plan_collection,
    plan_root,
    unmarked_root_refusal,
)
from payload_trees import refuse_listing

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


def test_a_directory_holding_only_busy_files_is_left_busy_not_failed(tmp_path: Path) -> None:
    (tmp_path / "v1" / "sub").mkdir(parents=True)
    (tmp_path / "v1" / "a.bin").write_bytes(b"12345")
    (tmp_path / "v1" / NFS).write_bytes(b"held open by a reader")
    (tmp_path / "v1" / "sub" / "b.bin").write_bytes(b"12")
    (tmp_path / "v1" / "sub" / FUSE).write_bytes(b"also held")
    report = collect_below_sync(tmp_path, 2)
    assert (report.outcome, report.errors, report.deleted) == ("busy", (), ())
    (busy,) = report.busy
    # The busy files are neither deleted nor counted; everything else went.
    assert (busy.name, busy.files, busy.bytes) == ("v1", 2, 7)
    assert busy.busy == 2
    assert sorted(busy.paths) == [f"v1/{NFS}", f"v1/sub/{FUSE}"]
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [NFS, "sub"]
    assert [p.name for p in (tmp_path / "v1" / "sub").iterdir()] == [FUSE]
    assert busy.message.startswith("2 busy files (")


def test_once_the_busy_files_are_gone_the_directory_goes(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / NFS).write_bytes(b"x")
    assert collect_below_sync(tmp_path, 2).outcome == "busy"
    # The client removes the name when the file is closed.
    (tmp_path / "v1" / NFS).unlink()
    report = collect_below_sync(tmp_path, 2)
    assert (report.outcome, report.busy, report.errors) == ("complete", (), ())
    assert [(d.name, d.files) for d in report.deleted] == [("v1", 0)]
    assert not (tmp_path / "v1").exists()


def test_a_directory_with_a_busy_like_name_is_removed_as_usual(tmp_path: Path) -> None:
    # Only files are silly-renamed: a directory of that name is no busy file.
    (tmp_path / "v1" / NFS).mkdir(parents=True)
    (tmp_path / "v1" / NFS / "c.bin").write_bytes(b"abc")
    report = collect_below_sync(tmp_path, 2)
    assert (report.outcome, report.busy) == ("complete", ())
    assert [(d.name, d.files, d.bytes) for d in report.deleted] == [("v1", 1, 3)]
    assert not (tmp_path / "v1").exists()


def test_a_busy_file_next_to_a_real_failure_is_still_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v1" / "locked").mkdir(parents=True)
    (tmp_path / "v1" / "locked" / "x").write_bytes(b"x")
    (tmp_path / "v1" / NFS).write_bytes(b"y")
    refuse_listing(monkeypatch, tmp_path / "v1" / "locked")
    report = collect_below_sync(tmp_path, 2)
    assert report.outcome == "partial"
    assert report.errors == (CollectionError("v1", "v1/locked: Permission denied"),)
    assert report.busy == ()
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [NFS, "locked"]


def test_measuring_counts_busy_files_apart(tmp_path: Path) -> None:
    (tmp_path / "v1" / "d").mkdir(parents=True)
    (tmp_path / "v1" / "a").write_bytes(b"12345")
    (tmp_path / "v1" / NFS).write_bytes(b"123456789")
    (tmp_path / "v1" / "d" / FUSE).write_bytes(b"1")
    (planned,) = plan_root(tmp_path, 2).delete
    assert planned.usage == Usage(files=1, bytes=5, busy=2)


def test_busy_paths_are_capped_but_counted(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    for i in range(40):
        (tmp_path / "v1" / f".nfs{i:024x}").write_bytes(b"x")
    (busy,) = collect_below_sync(tmp_path, 2).busy
    assert busy.busy == 40
    assert 0 < len(busy.paths) < 40
    assert f" and {40 - len(busy.paths)} more" in busy.message


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
