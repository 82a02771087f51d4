"""Single files inside version directories, reached the same safe way the collector walks.

A daemon deletes the files of a discarded rollout one by one, checks that a server's files
exist before it trusts them, and a trainer opens them to read. None of that may be
redirected outside the payload root by whoever else can write into it (an inference
server on another machine, a user): a version directory swapped for a symbolic link, or a
bind mount in its place, must not make us touch what it points at.

So every operation here goes: open the root (refusing a link), open `v<k>` relative to
it with `O_NOFOLLOW | O_DIRECTORY`, check that it is on the root's mount (by mount id, so a
bind mount of the same filesystem is caught too), then act on the file's plain name with
`*at` calls that never follow a link. A version directory that fails these checks is
refused whole: nothing in it is touched. All of it blocks: async callers use worker
threads.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from types import TracebackType

import attrs

from ._busy import is_busy_name
from ._errors import PayloadGCError, RootMissing
from ._mounts import MountId, fd_mount_id
from ._tree import DIR_FLAGS, Tally, open_root
from ._vanished import is_vanished
from ._versions import version_name

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class VersionDirRefused(PayloadGCError):
    """A version directory that is a symbolic link, not a directory, or a mount point:
    nothing in it is touched. `kind` says which: `symlink`, `not_directory` or
    `mount_point`."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class VersionDirMissing(PayloadGCError):
    """A version directory that does not exist (yet, or any more)."""


class BadFileName(PayloadGCError):
    """A file name that is not one plain entry of a directory (empty, `.`/`..`, a path
    separator, a NUL)."""


def plain_name_problem(name: str) -> str | None:
    """Why `name` is not a plain directory entry name, or `None` if it is one."""
    if not name:
        return "empty file name"
    if "\0" in name:
        return "NUL in file name"
    if name in {".", ".."}:
        return "file name is a directory reference"
    if "/" in name or "\\" in name:
        return "file name has a path separator"
    return None


def _check_name(name: str) -> None:
    problem = plain_name_problem(name)
    if problem is not None:
        raise BadFileName(f"{name!r}: {problem}")


@attrs.frozen
class FileRemoval:
    """What `remove_files` did: files unlinked and the bytes they held (regular files'
    sizes), and one line per thing it refused or failed to delete (kept to the first
    few, as a collection keeps them; `problem_count` counts them all). `busy` counts the
    busy files it was asked for and left alone (silly-renamed names, `.nfs<hex>` and
    `.fuse_hidden<hex>`: deleted already, gone once closed; not problems). `left` lists
    every `(version, name)` asked for that is still there by its name: the refused and
    failed ones and the busy ones."""

    files: int
    bytes: int
    problems: tuple[str, ...] = ()
    problem_count: int = 0
    busy: int = 0
    left: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(cls, tally: Tally, left: Iterable[tuple[int, str]] = ()) -> FileRemoval:
        return cls(
            tally.files,
            tally.bytes,
            tuple(tally.problems),
            tally.problem_count,
            tally.busy_count,
            tuple(left),
        )


class VersionDir:
    """One version directory, opened safely (see the module's docstring)."""

    def __init__(self, fd: int, label: str) -> None:
        self.fd = fd
        self.label = label

    def lstat(self, name: str) -> os.stat_result:
        """The entry `name` itself, never followed. Raises `BadFileName`, and `OSError`s:
        one that `is_vanished` if it is gone (`FileNotFoundError`, or `ESTALE` on NFS and
        FUSE mounts)."""
        _check_name(name)
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> int | None:
        """Unlink the non-directory `name`; its size if it was a regular file (0 for
        anything else), `None` if it was already gone (`is_vanished`). A directory is
        never removed.

        Raises `BadFileName`, `IsADirectoryError` for a directory, other `OSError`s."""
        try:
            st = self.lstat(name)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", f"{self.label}/{name}")
            os.unlink(name, dir_fd=self.fd)
        except OSError as exc:
            if is_vanished(exc):
                return None
            raise
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def open_file(self, name: str) -> int:
        """A read-only descriptor of the regular file `name` (never a link, never a FIFO
        or device: those are refused without blocking). The caller closes it.

        Raises `BadFileName`, an `OSError` that `is_vanished` if it is gone,
        `IsADirectoryError`, `OSError(ELOOP)` for a symbolic link, `OSError(EINVAL)` for
        anything else that is not a regular file."""
        _check_name(name)
        fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", f"{self.label}/{name}")
            if not stat.S_ISREG(mode):
                raise OSError(errno.EINVAL, "not a regular file", f"{self.label}/{name}")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


class PayloadRootFiles:
    """A payload root held open for file operations inside its version directories.

    Use as a context manager; version directories are opened on first use and kept open
    until it closes. Raises `RootMissing`, `RootRefused` or `PayloadGCError` when the
    root itself cannot be opened.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self._root_fd = open_root(self.root)
        try:
            self._mount: MountId = fd_mount_id(self._root_fd)
        except BaseException:
            os.close(self._root_fd)
            raise
        self._dirs: dict[int, VersionDir | PayloadGCError] = {}

    def __enter__(self) -> PayloadRootFiles:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for opened in self._dirs.values():
            if isinstance(opened, VersionDir):
                os.close(opened.fd)
        self._dirs.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def version(self, version: int) -> VersionDir:
        """`<root>/v<version>`, opened without following a link and checked to be on
        the root's mount. Raises `VersionDirMissing` or `VersionDirRefused` (the same
        error again for every later call with this version)."""
        opened = self._dirs.get(version)
        if opened is None:
            opened = self._dirs[version] = self._open_version(version)
        if isinstance(opened, PayloadGCError):
            raise opened
        return opened

    def _open_version(self, version: int) -> VersionDir | PayloadGCError:
        name = version_name(version)
        label = f"{self.root}/{name}"
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self._root_fd)
        except OSError as exc:
            if is_vanished(exc):
                return VersionDirMissing(f"{label}: no such directory")
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                # Linux answers ENOTDIR for a link opened with O_DIRECTORY | O_NOFOLLOW.
                if _is_link(self._root_fd, name):
                    return VersionDirRefused(f"{label}: a symbolic link", kind="symlink")
                return VersionDirRefused(f"{label}: not a directory", kind="not_directory")
            return PayloadGCError(f"{label}: cannot open: {exc.strerror}")
        try:
            same_mount = fd_mount_id(fd) == self._mount
        except OSError as exc:
            os.close(fd)
            return PayloadGCError(f"{label}: cannot inspect: {exc.strerror}")
        if not same_mount:
            os.close(fd)
            return VersionDirRefused(
                f"{label}: a mount point, not part of the payload root", kind="mount_point"
            )
        return VersionDir(fd, label)

    def remove_files(self, files: Iterable[tuple[int, str]]) -> FileRemoval:
        """Unlink each `(version, name)`: a plain file name in `v<version>`. Missing
        files and directories count as already deleted; a file in a refused version
        directory, a bad name, or a directory entry is left and reported; a busy name
        (silly-renamed: deleted while open) is left and counted as busy. Never raises
        for any of those."""
        tally = Tally()
        left: list[tuple[int, str]] = []
        for version, name in files:
            if is_busy_name(name):
                tally.busy(f"{self.root}/{version_name(version)}/{name}")
                left.append((version, name))
                continue
            try:
                freed = self.version(version).unlink(name)
            except VersionDirMissing:
                continue
            except (PayloadGCError, OSError) as exc:
                tally.problem(_problem_text(self.root, version, name, exc))
                left.append((version, name))
                continue
            if freed is not None:
                tally.files += 1
                tally.bytes += freed
        return FileRemoval.of(tally, left)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _problem_text(root: str, version: int, name: str, exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{root}/{version_name(version)}/{name}: {exc.strerror}"
    return str(exc)


def remove_files(root: str | os.PathLike[str], files: Iterable[tuple[int, str]]) -> FileRemoval:
    """Unlink files inside the version directories of `root` (see
    `PayloadRootFiles.remove_files`). A root that is gone removes nothing; a root that
    cannot be opened safely raises `RootRefused` or `PayloadGCError`."""
    try:
        opened = PayloadRootFiles(root)
    except RootMissing:
        return FileRemoval(0, 0)
    with opened:
        return opened.remove_files(files)
