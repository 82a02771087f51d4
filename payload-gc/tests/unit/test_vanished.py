"""What vanished means (`is_vanished`): an entry someone else removed, reported as
`ENOENT` or, on NFS and FUSE mounts, as `ESTALE` ("Stale file handle"). A collection, file
removal and the lock count it as gone, never as a problem (the payload readers on top:
tests/unit/test_gc_vanished.py).

Two emulations of what sshfs does (seen on `tests/netmount/mount.sh` mounts), so these run
on any filesystem:

- `stale_handles`: a call relative to a directory descriptor whose directory was removed
  fails with `ESTALE`, and so does listing it (a local filesystem answers `ENOENT`, or an
  empty listing);
- `no_rewind`: a directory descriptor lists once; listing it again gives nothing, as an
  SFTP directory handle does (sshfs cannot rewind it).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import payload_gc._scan as scan_module
import pytest
from payload_gc import (
    DeletedDir,
    PayloadRootFiles,
    collect_below_sync,
    is_vanished,
    plan_root,
    remove_files,
    scan_root,
)
from payload_trees import lock_by_another_host, make_version

NFS = ".nfs000000000123abcd00000001"
REAL_OPEN = os.open
REAL_STAT = os.stat
REAL_UNLINK = os.unlink
REAL_RMDIR = os.rmdir
REAL_SCANDIR = os.scandir


def _stale() -> OSError:
    return OSError(errno.ESTALE, os.strerror(errno.ESTALE))


def _removed(fd: int) -> bool:
    """Whether the directory open as `fd` was removed (a removed directory has no links)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return False


def _stale_relative(real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        dir_fd = kwargs.get("dir_fd")
        if dir_fd is not None and _removed(dir_fd):
            raise _stale()
        return real(*args, **kwargs)

    return call


def _stale_scandir(path: Any = ".") -> Any:
    if isinstance(path, int) and _removed(path):
        raise _stale()
    return REAL_SCANDIR(path)


@pytest.fixture
def stale_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    reals: dict[str, Callable[..., Any]] = {
        "open": REAL_OPEN,
        "stat": REAL_STAT,
        "unlink": REAL_UNLINK,
        "rmdir": REAL_RMDIR,
    }
    for name, real in reals.items():
        monkeypatch.setattr(os, name, _stale_relative(real))
    monkeypatch.setattr(os, "scandir", _stale_scandir)


@pytest.fixture
def no_rewind(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An open directory lists once: listing it again (through the same descriptor or a
    duplicate, which share their open file) gives nothing, as an SFTP directory handle
    does. A directory opened again is a new open file, listed afresh."""
    empty = str(tmp_path_factory.mktemp("empty"))
    opened: dict[int, object] = {}  # descriptor -> its open file
    listed: set[int] = set()  # id() of the open files listed
    real_close, real_dup = os.close, os.dup

    def open_(*args: Any, **kwargs: Any) -> int:
        fd: int = REAL_OPEN(*args, **kwargs)
        opened[fd] = object()
        return fd

    def dup(fd: int) -> int:
        new = real_dup(fd)
        opened[new] = opened.setdefault(fd, object())
        return new

    def close(fd: int) -> None:
        opened.pop(fd, None)
        real_close(fd)

    def scandir(path: Any = ".") -> Any:
        if isinstance(path, int):
            open_file = id(opened.setdefault(path, object()))
            if open_file in listed:
                return REAL_SCANDIR(empty)
            listed.add(open_file)
        return REAL_SCANDIR(path)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "dup", dup)
    monkeypatch.setattr(os, "close", close)
    monkeypatch.setattr(os, "scandir", scandir)


def _make_version(root: Path, version: int, names: tuple[str, ...] = ("a", "b", "c")) -> Path:
    return make_version(root, version, names=names)


def _on_first_unlink(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[str | os.PathLike[str], int | None], None]
) -> None:
    """Run `action(name, dir_fd)` before the first `os.unlink` of a payload file (not the
    collector's own `lock.*` files), then unlink as the patched `os.unlink` did before."""
    inner = os.unlink
    done = False

    def unlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        nonlocal done
        if not done and not os.fspath(path).startswith("lock"):
            done = True
            action(path, dir_fd)
        inner(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)


@pytest.mark.parametrize(
    ("code", "vanished"),
    [
        (errno.ENOENT, True),
        (errno.ESTALE, True),
        (errno.EACCES, False),
        (errno.ENOTEMPTY, False),
        (errno.EIO, False),
    ],
)
def test_vanished_is_enoent_or_estale(code: int, vanished: bool) -> None:
    assert is_vanished(OSError(code, os.strerror(code))) is vanished


def test_emptying_a_directory_another_remover_removed_is_success(
    tmp_path: Path, stale_handles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _make_version(tmp_path, 0)
    (directory / "sub").mkdir()
    (directory / "sub" / "d").write_bytes(b"d")
    # Another remover takes the whole directory away while this one is in it: every call
    # in it is then refused as stale, as on sshfs.
    _on_first_unlink(monkeypatch, lambda path, dir_fd: shutil.rmtree(directory))
    report = collect_below_sync(tmp_path, 1)
    assert (report.errors, report.deleted) == ((), (DeletedDir("v0", 0, 0, 0),))
    assert not directory.exists()


def test_a_directory_removed_before_its_rescan_is_gone(
    tmp_path: Path, stale_handles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _make_version(tmp_path, 0, ("a",))

    def unlink_all(path: str | os.PathLike[str], dir_fd: int | None) -> None:
        # The other remover gets there first, then removes the directory too.
        REAL_UNLINK(path, dir_fd=dir_fd)
        REAL_RMDIR(directory)

    _on_first_unlink(monkeypatch, unlink_all)
    report = collect_below_sync(tmp_path, 1)
    assert (report.errors, report.deleted) == ((), (DeletedDir("v0", 0, 0, 0),))


@pytest.mark.parametrize("late", ["written", "silly-renamed"])
def test_a_rescan_lists_the_directory_afresh(
    tmp_path: Path, no_rewind: None, monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    # While the directory is emptied, a writer adds a file, or a file open elsewhere is
    # silly-renamed instead of unlinked: the rescan must see it although the directory's
    # descriptor cannot be listed twice.
    directory = _make_version(tmp_path, 0, ("a",))

    def meanwhile(path: str | os.PathLike[str], dir_fd: int | None) -> None:
        if late == "written":
            (directory / "late").write_bytes(b"late")
        else:
            (directory / "b").rename(directory / NFS)

    (directory / "b").write_bytes(b"b")
    _on_first_unlink(monkeypatch, meanwhile)
    report = collect_below_sync(tmp_path, 1)
    assert report.errors == ()
    if late == "written":
        assert [(d.name, d.files) for d in report.deleted] == [("v0", 3)]
    else:
        assert report.deleted == ()
        assert [b.paths for b in report.busy] == [(f"v0/{NFS}",)]
        assert sorted(os.listdir(directory)) == [NFS]


def test_a_version_removed_by_someone_else_after_the_plan_counts_as_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_version(tmp_path, 0)
    _make_version(tmp_path, 1)

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if path == "v1" and kwargs.get("dir_fd") is not None:
            shutil.rmtree(tmp_path / "v1")
            raise _stale()
        return REAL_STAT(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    report = collect_below_sync(tmp_path, 2)
    assert report.errors == ()
    assert sorted(d.name for d in report.deleted) == ["v0", "v1"]


def test_an_entry_vanishing_while_the_root_is_listed_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_version(tmp_path, 0)
    _make_version(tmp_path, 5)

    # The mount check is `statx` by ctypes, which no patch of `os` reaches.
    real_entry_mount_id = scan_module.entry_mount_id

    def entry_mount_id(dir_fd: int, name: str) -> tuple[str, int]:
        if name == "v0":
            raise _stale()
        return real_entry_mount_id(dir_fd, name)

    monkeypatch.setattr(scan_module, "entry_mount_id", entry_mount_id)
    assert [e.name for e in scan_root(tmp_path, measure=False)] == ["v5"]
    plan = plan_root(tmp_path, 3, measure=False)
    assert plan.delete == ()


def test_removing_files_of_a_version_collected_meanwhile_is_success(
    tmp_path: Path, stale_handles: None
) -> None:
    directory = _make_version(tmp_path, 1)
    with PayloadRootFiles(tmp_path) as files:
        files.version(1)  # held open, as the daemon's file checks hold it
        shutil.rmtree(directory)  # the collector took the whole version
        removal = files.remove_files([(1, "a"), (1, "b")])
    assert (removal.files, removal.problems, removal.left) == (0, (), ())
    assert remove_files(tmp_path, [(1, "c")]).problems == ()


def test_a_lock_released_while_it_is_read_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v0").mkdir()
    lock_by_another_host(tmp_path)
    lock = tmp_path / ".payload-gc" / "lock"
    released = False

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        nonlocal released
        if path == "lock" and not flags & os.O_CREAT and not released:
            # Its holder released it between our create and our read.
            released = True
            lock.unlink()
            raise _stale()
        return REAL_OPEN(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    report = collect_below_sync(tmp_path, 1)
    assert released
    assert [d.name for d in report.deleted] == ["v0"]
    assert not lock.exists()
