"""File-descriptor-relative walking and deletion that never follows a symbolic link and
never leaves the root's mount (a bind mount of the same filesystem included).

Every path below the root is reached as `name` relative to an open directory descriptor
(`os.open(..., dir_fd=...)` with `O_NOFOLLOW | O_DIRECTORY`), so swapping a directory for
a link while we work cannot redirect us outside the root. Every directory is opened
first and then checked against the root's mount identity (`_mounts.fd_mount_id`, one
`statx` per directory, none per file), so a mount point is never entered. Busy files
(`_busy.py`: deleted while open, silly-renamed) are never unlinked: a directory holding
only those is left in place as busy, not as a failure. An entry that vanished (`ENOENT`,
or `ESTALE` on NFS and FUSE mounts: `_vanished.py`) was deleted by someone else and
counts as deleted. All functions here block: the async API runs them in worker threads.
"""

from __future__ import annotations

import errno
import os
import stat

import attrs

from ._busy import busy_text, is_busy_name
from ._errors import PayloadGCError, RootMissing, RootRefused
from ._mounts import MountId, fd_mount_id
from ._plan import EntryKind, Usage
from ._vanished import is_vanished

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: A tally keeps this many problem messages; beyond that it only counts them, so a tree
#: of a million unreadable files cannot produce a million-line report.
MAX_PROBLEMS_KEPT = 20

#: How often a directory is listed again when a writer added entries while we emptied it
#: (a still-running stale rollout may write into a version directory being collected).
RESCANS = 2


@attrs.define
class Tally:
    """What a deletion removed so far, what it could not remove (`problems`), and the busy
    files it left alone (`busy_paths`: deleted while open, see `_busy.py`); each list keeps
    the first few, the counts count them all."""

    files: int = 0
    bytes: int = 0
    problems: list[str] = attrs.field(factory=list)
    problem_count: int = 0
    busy_paths: list[str] = attrs.field(factory=list)
    busy_count: int = 0

    def problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(message)

    def busy(self, path: str) -> None:
        self.busy_count += 1
        if len(self.busy_paths) < MAX_PROBLEMS_KEPT:
            self.busy_paths.append(path)

    def busy_summary(self) -> str:
        """The busy files as one line (the first few paths, and how many there were)."""
        return busy_text(self.busy_count, self.busy_paths)

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


def dirent_kind(entry: os.DirEntry[str]) -> EntryKind:
    """What a listed entry is, from the listing itself (`d_type`): no `lstat`, except on
    a filesystem whose listing does not give types (then `os.DirEntry` makes one). An
    entry that vanished before that `lstat` counts as `OTHER`."""
    try:
        if entry.is_symlink():
            return EntryKind.SYMLINK
        if entry.is_dir(follow_symlinks=False):
            return EntryKind.DIRECTORY
        if entry.is_file(follow_symlinks=False):
            return EntryKind.FILE
    except OSError:
        pass
    return EntryKind.OTHER


def entry_kind(mode: int) -> EntryKind:
    if stat.S_ISDIR(mode):
        return EntryKind.DIRECTORY
    if stat.S_ISLNK(mode):
        return EntryKind.SYMLINK
    if stat.S_ISREG(mode):
        return EntryKind.FILE
    return EntryKind.OTHER


def list_dir(dir_fd: int) -> list[os.DirEntry[str]]:
    """The entries of a directory opened and not yet read (read in full before anything
    is deleted, since deleting while reading a directory stream may skip entries on some
    filesystems). The entries' `stat` and `is_*` use `dir_fd`: keep it open while they
    are used.

    A descriptor already read must not be listed again: that relies on rewinding it,
    which not every filesystem does (sshfs keeps one SFTP directory handle per
    descriptor, read once: a second listing comes back empty, and sshfs caches that
    empty listing for the path too). Open the directory again instead (`reopen_dir`).
    """
    with os.scandir(dir_fd) as it:
        return list(it)


def reopen_dir(dir_fd: int) -> int:
    """A new descriptor of the same open directory (`.` relative to it: the directory
    itself, never another mount, even one mounted over it since), to list it afresh.
    Raises `OSError`; one that `is_vanished` when the directory was removed."""
    return os.open(".", DIR_FLAGS, dir_fd=dir_fd)


def measure_dir(parent_fd: int, name: str, root_mount: MountId) -> Usage:
    """Count the files and bytes below directory `name` of `parent_fd` without following
    links or entering a mount point (a directory whose mount identity is not
    `root_mount`, the root's; `name` itself included: then nothing is counted). Busy
    files (silly-renamed, `_busy.py`) are counted apart, in `busy`, not in `files` or
    `bytes`. Entries that vanish or cannot be read count as nothing.

    Raises `OSError` if `name` itself cannot be opened and listed as a directory.
    """
    files = size = busy = 0
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
                if entry.name[:1] == "." and is_busy_name(entry.name):
                    busy += 1
                    continue
                if entry.is_file(follow_symlinks=False):
                    size += entry.stat(follow_symlinks=False).st_size
                files += 1
            except OSError:
                continue
    finally:
        for fd, _ in frames:
            os.close(fd)
    return Usage(files=files, bytes=size, busy=busy)


@attrs.define
class _Frame:
    """A directory being emptied: its descriptor and the entries not yet visited."""

    fd: int
    path: str
    name: str
    pending: list[os.DirEntry[str]]
    failed: bool = False
    rescans: int = 0
    #: Whether `fd` has been listed: a rescan lists a new descriptor (`reopen_dir`).
    listed: bool = False
    #: Names left in it because they are busy: busy files, and subdirectories that were
    #: left busy themselves. Later listings skip them.
    busy: set[str] = attrs.field(factory=set)


def remove_tree(parent_fd: int, name: str, path: str, root_mount: MountId, tally: Tally) -> bool:
    """Delete `name` in directory `parent_fd`: a directory with everything below it, or a
    symbolic link or file (unlinked, never followed). `path` labels it in problems.

    Never follows a link, never enters a directory whose mount identity is not
    `root_mount` (the root's: a mount point, a bind mount of the same filesystem
    included, is left in place and reported), and treats an entry that vanished as
    deleted. Problems (e.g. permission denied) are recorded in `tally` and the rest is
    still deleted. Busy files are never unlinked: they are recorded in `tally.busy_paths`,
    and the directories holding them stay without a problem being recorded. Returns
    whether `name` is gone.
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
            left = _FAILED if frame.failed else _rmdir(parent, frame, tally)
            if left == _GONE:
                continue
            if not frames:
                return False
            if left == _BUSY:
                frames[-1].busy.add(frame.name)
            else:
                frames[-1].failed = True
        return True
    finally:
        for frame in frames:
            os.close(frame.fd)


# Sentinels returned by _open_subdir and _rmdir (descriptors are never negative).
_GONE = -1
_FAILED = -2
_BUSY = -3


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
    except OSError as exc:
        if is_vanished(exc):
            return _GONE
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return None
        tally.problem(f"{path}: {exc.strerror}")
        return _FAILED
    try:
        same_mount = fd_mount_id(fd) == root_mount
    except OSError as exc:
        os.close(fd)
        if is_vanished(exc):
            return _GONE
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
    """List the frame's directory (again) into `pending`, leaving out busy entries (new
    busy files are recorded, once each). A rescan first swaps the frame's descriptor for
    a new one of the same directory (`list_dir` says why). A directory that vanished
    meanwhile lists as empty: removing it then finds it gone."""
    try:
        if frame.listed:
            fd = reopen_dir(frame.fd)
            os.close(frame.fd)
            frame.fd = fd
        frame.listed = True
        listed = list_dir(frame.fd)
    except OSError as exc:
        if is_vanished(exc):
            frame.pending = []
            return
        tally.problem(f"{frame.path}: {exc.strerror}")
        frame.failed = True
        return
    busy = frame.busy
    frame.pending = [
        entry
        for entry in listed
        if not (
            (busy and entry.name in busy)
            or (entry.name[:1] == "." and _newly_busy(frame, entry, tally))
        )
    ]


def _newly_busy(frame: _Frame, entry: os.DirEntry[str], tally: Tally) -> bool:
    """Whether `entry` is a busy file (then recorded in the frame and the tally)."""
    if not is_busy_name(entry.name):
        return False
    try:
        if entry.is_dir(follow_symlinks=False):
            return False  # only files are silly-renamed: a directory is removed as usual
    except OSError:
        pass
    frame.busy.add(entry.name)
    tally.busy(f"{frame.path}/{entry.name}")
    return True


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
            except OSError as exc:
                if is_vanished(exc):
                    continue  # removed by someone else: fine
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
    """Unlink a non-directory, counting it (and its size if it is a regular file); a busy
    file is left alone and recorded as busy."""
    size = 0
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            # Replaced by a directory since it was listed; delete that instead (rare, so
            # the recursion stays shallow).
            return remove_tree(dir_fd, name, path, root_mount, tally)
        if is_busy_name(name):
            tally.busy(path)
            return False
        if stat.S_ISREG(st.st_mode):
            size = st.st_size
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        return remove_tree(dir_fd, name, path, root_mount, tally)
    except OSError as exc:
        if is_vanished(exc):
            return True
        tally.problem(f"{path}: {exc.strerror}")
        return False
    tally.files += 1
    tally.bytes += size
    return True


def _rmdir(parent_fd: int, frame: _Frame, tally: Tally) -> int:
    """Remove the frame's emptied directory: `_GONE`, or `_BUSY` when it still holds busy
    entries (its last listing showed nothing else), or `_FAILED` (problem recorded). A
    directory whose busy files were closed meanwhile is removed like any other."""
    try:
        os.rmdir(frame.name, dir_fd=parent_fd)
    except OSError as exc:
        if is_vanished(exc):
            return _GONE
        if frame.busy and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return _BUSY
        tally.problem(f"{frame.path}: {exc.strerror}")
        return _FAILED
    return _GONE
