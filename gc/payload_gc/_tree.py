"""File-descriptor-relative walking and deletion that never follows a symbolic link and
never leaves the root's mount (a bind mount of the same filesystem included).

Every path below the root is reached as `name` relative to an open directory descriptor
(`os.open(..., dir_fd=...)` with `O_NOFOLLOW | O_DIRECTORY`), so swapping a directory for
a link while we work cannot redirect us outside the root. Every directory is opened
first and then checked against the root's mount identity (`_mounts.fd_mount_id`, one
`statx` per directory, none per file), so a mount point is never entered. All functions
here block: the async API runs them in worker threads.
"""

from __future__ import annotations

import errno
import os
import stat

import attrs

from ._errors import PayloadGCError, RootMissing, RootRefused
from ._mounts import MountId, fd_mount_id
from ._plan import EntryKind, Usage

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: A tally keeps this many problem messages; beyond that it only counts them, so a tree
#: of a million unreadable files cannot produce a million-line report.
MAX_PROBLEMS_KEPT = 20

#: How often a directory is listed again when a writer added entries while we emptied it
#: (a still-running stale rollout may write into a version directory being collected).
RESCANS = 2


@attrs.define
class Tally:
    """What a deletion removed so far, and what it could not remove."""

    files: int = 0
    bytes: int = 0
    problems: list[str] = attrs.field(factory=list)
    problem_count: int = 0

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(message)

    def summary(self) -> str:
        """The problems as one line (the first few, and how many more there were)."""
        text = "; ".join(self.problems)
        hidden = self.problem_count - len(self.problems)
        return f"{text}; and {hidden} more" if hidden > 0 else text


def open_root(root: str) -> int:
    """Open the payload root as a directory descriptor, refusing a symbolic link.

    Raises `RootMissing` if it does not exist, `RootRefused` if it is a symbolic link or
    not a directory, `PayloadGCError` if it cannot be opened (e.g. permission denied).
    """
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        raise RootMissing(f"payload root {root} does not exist") from None
    except OSError as exc:
        raise PayloadGCError(f"cannot inspect payload root {root}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise RootRefused(
            f"payload root {root} is a symbolic link; refusing (pass the real directory)"
        )
    if not stat.S_ISDIR(mode):
        raise RootRefused(f"payload root {root} is not a directory")
    try:
        return os.open(root, DIR_FLAGS)
    except FileNotFoundError:
        raise RootMissing(f"payload root {root} does not exist") from None
    except OSError as exc:
        # ELOOP/ENOTDIR: replaced by a link or a file since the lstat above.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RootRefused(f"payload root {root} is not a plain directory") from None
        raise PayloadGCError(f"cannot open payload root {root}: {exc.strerror}") from None


def entry_kind(mode: int) -> EntryKind:
    if stat.S_ISDIR(mode):
        return EntryKind.DIRECTORY
    if stat.S_ISLNK(mode):
        return EntryKind.SYMLINK
    if stat.S_ISREG(mode):
        return EntryKind.FILE
    return EntryKind.OTHER


def list_dir(dir_fd: int) -> list[os.DirEntry[str]]:
    """The entries of an open directory (read in full before anything is deleted, since
    deleting while reading a directory stream may skip entries on some filesystems)."""
    with os.scandir(dir_fd) as it:
        return list(it)


def measure_dir(parent_fd: int, name: str, root_mount: MountId) -> Usage:
    """Count the files and bytes below directory `name` of `parent_fd` without following
    links or entering a mount point (a directory whose mount identity is not
    `root_mount`, the root's; `name` itself included: then nothing is counted). Entries
    that vanish or cannot be read count as nothing.

    Raises `OSError` if `name` itself cannot be opened and listed as a directory.
    """
    files = size = 0
    top = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        if fd_mount_id(top) != root_mount:
            os.close(top)
            return Usage(files=0, bytes=0)
        frames = [(top, list_dir(top))]
    except OSError:
        os.close(top)
        raise
    try:
        while frames:
            fd, pending = frames[-1]
            if not pending:
                os.close(fd)
                frames.pop()
                continue
            entry = pending.pop()
            try:
                if entry.is_dir(follow_symlinks=False):
                    child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                    try:
                        if fd_mount_id(child) == root_mount:
                            frames.append((child, list_dir(child)))
                            continue
                    except OSError:
                        pass
                    os.close(child)
                    continue
                if entry.is_file(follow_symlinks=False):
                    size += entry.stat(follow_symlinks=False).st_size
                files += 1
            except OSError:
                continue
    finally:
        for fd, _ in frames:
            os.close(fd)
    return Usage(files=files, bytes=size)


@attrs.define
class _Frame:
    """A directory being emptied: its descriptor and the entries not yet visited."""

    fd: int
    path: str
    name: str
    pending: list[os.DirEntry[str]]
    failed: bool = False
    rescans: int = 0


def remove_tree(parent_fd: int, name: str, path: str, root_mount: MountId, tally: Tally) -> bool:
    """Delete `name` in directory `parent_fd`: a directory with everything below it, or a
    symbolic link or file (unlinked, never followed). `path` labels it in problems.

    Never follows a link, never enters a directory whose mount identity is not
    `root_mount` (the root's: a mount point, a bind mount of the same filesystem
    included, is left in place and reported), and treats an entry that vanished as
    deleted. Problems (e.g. permission denied) are recorded in `tally` and the rest is
    still deleted. Returns whether `name` is gone.
    """
    top = _open_subdir(parent_fd, name, path, root_mount, tally)
    if top is None:
        return _unlink(parent_fd, name, path, root_mount, tally)
    if top < 0:
        return top == _GONE
    frames = [_new_frame(top, path, name, tally)]
    try:
        while frames:
            frame = frames[-1]
            if frame.pending:
                _drain(frame, frames, root_mount, tally)
                continue
            if not frame.failed and frame.rescans < RESCANS:
                # Empty for now: look again once, in case a writer added entries meanwhile.
                frame.rescans += 1
                _relist(frame, tally)
                if frame.pending:
                    continue
            frames.pop()
            os.close(frame.fd)
            parent = frames[-1].fd if frames else parent_fd
            removed = not frame.failed and _rmdir(parent, frame.name, frame.path, tally)
            if not removed:
                if not frames:
                    return False
                frames[-1].failed = True
        return True
    finally:
        for frame in frames:
            os.close(frame.fd)


# Sentinels returned by _open_subdir (descriptors are never negative).
_GONE = -1
_FAILED = -2


#: How a mount point left in place is reported (after its path).
MOUNT_POINT_LEFT = "mount point (not entered), left in place"


def _open_subdir(
    parent_fd: int, name: str, path: str, root_mount: MountId, tally: Tally
) -> int | None:
    """Open directory `name` without following links: its descriptor, `None` if it is
    not a directory (a link or a file: unlink it instead), `_GONE` if it vanished,
    `_FAILED` (problem recorded) if it cannot be opened or is on another mount than the
    root (checked on the open descriptor, so it cannot be swapped after the check)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return _GONE
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return None
        tally.problem(f"{path}: {exc.strerror}")
        return _FAILED
    try:
        same_mount = fd_mount_id(fd) == root_mount
    except OSError as exc:
        os.close(fd)
        tally.problem(f"{path}: {exc.strerror}")
        return _FAILED
    if not same_mount:
        os.close(fd)
        tally.problem(f"{path}: {MOUNT_POINT_LEFT}")
        return _FAILED
    return fd


def _new_frame(fd: int, path: str, name: str, tally: Tally) -> _Frame:
    """A frame for the open directory `fd`, listed; a listing that fails is recorded and
    marks the frame failed (its directory cannot be emptied, so it stays)."""
    frame = _Frame(fd, path, name, [])
    _relist(frame, tally)
    return frame


def _relist(frame: _Frame, tally: Tally) -> None:
    try:
        frame.pending = list_dir(frame.fd)
    except OSError as exc:
        tally.problem(f"{frame.path}: {exc.strerror}")
        frame.failed = True


def _drain(frame: _Frame, frames: list[_Frame], root_mount: MountId, tally: Tally) -> None:
    """Unlink the frame's pending non-directories until it meets a subdirectory, which
    is pushed as a new frame (or the pending list runs out).

    This is the hot loop (one pass per file), so it unlinks inline and builds no path
    strings unless something goes wrong.
    """
    fd, pending = frame.fd, frame.pending
    files = size = 0
    try:
        while pending:
            entry = pending.pop()
            name = entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                path = f"{frame.path}/{name}"
                child = _open_subdir(fd, name, path, root_mount, tally)
                if child is None:
                    ok = _unlink(fd, name, path, root_mount, tally)
                elif child >= 0:
                    frames.append(_new_frame(child, path, name, tally))
                    return
                else:
                    ok = child == _GONE
                if not ok:
                    frame.failed = True
                continue
            try:
                # Only regular files have a size worth counting; links count as files.
                nbytes = (
                    os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
                    if entry.is_file(follow_symlinks=False)
                    else 0
                )
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue  # removed by someone else: fine
            except OSError:
                # Rare cases (replaced by a directory, permission denied) take the slow path.
                if not _unlink(fd, name, f"{frame.path}/{name}", root_mount, tally):
                    frame.failed = True
                continue
            files += 1
            size += nbytes
    finally:
        tally.files += files
        tally.bytes += size


def _unlink(dir_fd: int, name: str, path: str, root_mount: MountId, tally: Tally) -> bool:
    """Unlink a non-directory, counting it (and its size if it is a regular file)."""
    size = 0
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            # Replaced by a directory since it was listed; delete that instead (rare, so
            # the recursion stays shallow).
            return remove_tree(dir_fd, name, path, root_mount, tally)
        if stat.S_ISREG(st.st_mode):
            size = st.st_size
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except IsADirectoryError:
        return remove_tree(dir_fd, name, path, root_mount, tally)
    except OSError as exc:
        tally.problem(f"{path}: {exc.strerror}")
        return False
    tally.files += 1
    tally.bytes += size
    return True


def _rmdir(parent_fd: int, name: str, path: str, tally: Tally) -> bool:
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return True
    except OSError as exc:
        tally.problem(f"{path}: {exc.strerror}")
        return False
    return True
