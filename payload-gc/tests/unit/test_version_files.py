"""payload_gc's single-file access inside version directories: what the daemon deletes,
checks and a trainer opens goes the collector's way (fd-relative, never following a link,
never into a mount point), so no trap in the shared root redirects it outside."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from payload_gc import (
    BadFileName,
    PayloadRootFiles,
    RootRefused,
    VersionDirMissing,
    VersionDirRefused,
    remove_files,
)

if TYPE_CHECKING:
    from suite_plugin import BindMount


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    directory = tmp_path / "outside"
    directory.mkdir()
    for index in range(3):
        (directory / f"f{index}").write_bytes(b"x" * 100)
    return directory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    directory = tmp_path / "root"
    (directory / "v1").mkdir(parents=True)
    (directory / "v1" / "a.bin").write_bytes(b"a" * 10)
    (directory / "v1" / "b.bin").write_bytes(b"b" * 20)
    return directory


def test_remove_files_counts_what_was_on_disk(root: Path) -> None:
    removal = remove_files(root, [(1, "a.bin"), (1, "b.bin"), (1, "gone.bin"), (7, "x")])
    assert (removal.files, removal.bytes, removal.problem_count) == (2, 30, 0)
    assert list((root / "v1").iterdir()) == []


def test_a_linked_version_dir_is_refused_whole(root: Path, outside: Path) -> None:
    (root / "v2").symlink_to(outside, target_is_directory=True)
    removal = remove_files(root, [(2, "f0"), (2, "f1")])
    assert removal.files == 0 and removal.problem_count == 2
    assert "symbolic link" in removal.problems[0]
    assert sorted(p.name for p in outside.iterdir()) == ["f0", "f1", "f2"]
    with PayloadRootFiles(root) as files, pytest.raises(VersionDirRefused) as info:
        files.version(2)
    assert info.value.kind == "symlink"


def test_a_linked_file_is_unlinked_not_followed(root: Path, outside: Path) -> None:
    (root / "v1" / "link").symlink_to(outside / "f0")
    removal = remove_files(root, [(1, "link")])
    assert (removal.files, removal.bytes) == (1, 0)
    assert (outside / "f0").read_bytes() == b"x" * 100


@pytest.mark.parametrize("name", ["", ".", "..", "../outside/f0", "a/b", "a\\b", "a\0b"])
def test_names_that_are_not_plain_are_refused(root: Path, name: str) -> None:
    removal = remove_files(root, [(1, name)])
    assert removal.files == 0 and removal.problem_count == 1
    with PayloadRootFiles(root) as files, pytest.raises(BadFileName):
        files.version(1).lstat(name)
    assert (root / "v1").is_dir()


def test_a_directory_is_never_removed(root: Path) -> None:
    (root / "v1" / "sub").mkdir()
    removal = remove_files(root, [(1, "sub")])
    assert removal.files == 0 and removal.problem_count == 1
    assert (root / "v1" / "sub").is_dir()


def test_open_file_refuses_links_fifos_and_directories_without_blocking(root: Path) -> None:
    os.mkfifo(root / "v1" / "fifo")
    (root / "v1" / "link").symlink_to(root / "v1" / "a.bin")
    (root / "v1" / "dir").mkdir()
    with PayloadRootFiles(root) as files:
        directory = files.version(1)
        fd = directory.open_file("a.bin")
        try:
            assert os.read(fd, 100) == b"a" * 10
        finally:
            os.close(fd)
        for name in ("fifo", "link", "dir"):
            with pytest.raises(OSError):
                directory.open_file(name)
        with pytest.raises(VersionDirMissing):
            files.version(9)


def test_a_linked_root_is_refused(tmp_path: Path, root: Path) -> None:
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    with pytest.raises(RootRefused):
        remove_files(tmp_path / "link", [(1, "a.bin")])
    assert (root / "v1" / "a.bin").exists()


def test_a_missing_root_removes_nothing(tmp_path: Path) -> None:
    assert remove_files(tmp_path / "nowhere", [(1, "a.bin")]).files == 0


@pytest.fixture
def bind_mounted_version(root: Path, outside: Path, bind_mount: BindMount) -> Iterator[Path]:
    """`root/v3` as a bind mount of `outside` (same filesystem: same st_dev)."""
    target = root / "v3"
    target.mkdir()
    with bind_mount(outside, target):
        yield target


def test_a_bind_mounted_version_dir_is_refused(
    root: Path, outside: Path, bind_mounted_version: Path
) -> None:
    assert os.stat(bind_mounted_version).st_dev == os.stat(root).st_dev
    removal = remove_files(root, [(3, "f0"), (3, "f1")])
    assert removal.files == 0 and removal.problem_count == 2
    assert "mount point" in removal.problems[0]
    assert sorted(p.name for p in outside.iterdir()) == ["f0", "f1", "f2"]
    with PayloadRootFiles(root) as files, pytest.raises(VersionDirRefused) as info:
        files.version(3)
    assert info.value.kind == "mount_point"
