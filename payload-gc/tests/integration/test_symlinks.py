"""Symbolic-link attacks: the collector never follows a link out of the root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from payload_gc import (
    EntryKind,
    RootRefused,
    collect_below_sync,
    plan_root,
    wipe_root,
)


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.bin").write_bytes(b"do not delete")
    (outside / "sub" / "deep.bin").write_bytes(b"nor this")
    return outside


def _assert_outside_intact(outside: Path) -> None:
    assert (outside / "precious.bin").read_bytes() == b"do not delete"
    assert (outside / "sub" / "deep.bin").read_bytes() == b"nor this"


def test_version_link_to_an_outside_directory_is_unlinked_not_entered(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / "v3").symlink_to(outside, target_is_directory=True)
    plan = plan_root(root, 4)
    assert [(d.name, d.kind, d.usage) for d in plan.delete] == [
        ("v3", EntryKind.SYMLINK, plan.delete[0].usage)
    ]
    assert plan.delete[0].usage is not None
    assert plan.delete[0].usage.files == 0
    report = collect_below_sync(root, 4)
    assert [(d.name, d.files, d.bytes) for d in report.deleted] == [("v3", 0, 0)]
    assert not os.path.lexists(root / "v3")
    _assert_outside_intact(outside)


def test_links_inside_a_version_to_outside_files_and_dirs(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    root = tmp_path / "root"
    (root / "v2" / "nested").mkdir(parents=True)
    (root / "v2" / "own.bin").write_bytes(b"mine")
    (root / "v2" / "to_dir").symlink_to(outside, target_is_directory=True)
    (root / "v2" / "to_file").symlink_to(outside / "precious.bin")
    (root / "v2" / "nested" / "to_sub").symlink_to(outside / "sub", target_is_directory=True)
    (root / "v2" / "dangling").symlink_to(tmp_path / "does-not-exist")
    report = collect_below_sync(root, 3)
    assert [d.name for d in report.deleted] == ["v2"]
    # Five non-directory entries: the own file and four links (counted, never followed).
    assert (report.files, report.bytes) == (5, 4)
    assert not (root / "v2").exists()
    _assert_outside_intact(outside)


def test_root_that_is_a_link_is_refused_and_nothing_is_touched(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "v0").mkdir(parents=True)
    (real / "v0" / "x.bin").write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(RootRefused, match="symbolic link"):
        collect_below_sync(link, 10)
    with pytest.raises(RootRefused, match="symbolic link"):
        plan_root(link, 10)
    with pytest.raises(RootRefused, match="symbolic link"):
        wipe_root(link)
    assert (real / "v0" / "x.bin").read_bytes() == b"x"
    assert sorted(p.name for p in real.iterdir()) == ["v0"]


def test_control_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    root = tmp_path / "root"
    (root / "v0").mkdir(parents=True)
    (root / ".payload-gc").symlink_to(outside, target_is_directory=True)
    with pytest.raises(Exception, match=r"\.payload-gc"):
        collect_below_sync(root, 1)
    assert (root / "v0").is_dir()
    assert sorted(p.name for p in outside.iterdir()) == ["precious.bin", "sub"]


def test_wipe_unlinks_links_without_following_them(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    root = tmp_path / "root"
    (root / "v1").mkdir(parents=True)
    (root / ".payload-root").write_text("marker")
    (root / "v1" / "escape").symlink_to(outside, target_is_directory=True)
    (root / "top-link").symlink_to(outside, target_is_directory=True)
    report = wipe_root(root)
    assert report.entries == 2
    assert sorted(p.name for p in root.iterdir()) == [".payload-gc", ".payload-root"]
    _assert_outside_intact(outside)
