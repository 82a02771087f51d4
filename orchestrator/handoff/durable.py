"""Crash-safe writes for the shared filesystem: new files, replaced files, step directories.

A reader on another host must see either nothing or the whole file, and a power loss
must not leave a name pointing at a half-written file. A new file is created exclusively,
written whole and fsynced before it is closed (`write_new_file`, the one home of that
sequence); a replaced file is written under a temp name and renamed over the old one; a
step directory of any hand-off format is filled under a temp name and renamed into place
(`publish_step_dir`). Whatever is written under a temp name is named by `temp_name`, so a
leftover of a write cut short by a crash is recognised by `TEMP_PREFIX` (and removed at
start-up by `remove_partial_batches`). All functions block: call them from a worker
thread in async code.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# Every temp name starts with this, and no name that readers look for does.
TEMP_PREFIX = ".tmp-"
# Leftovers of a publish cut short by a crash start with this; nothing else does.
PARTIAL_BATCH_PREFIX = TEMP_PREFIX
# The most buffers one writev(2) takes (IOV_MAX: 1024 on Linux).
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))


class BatchExists(FileExistsError):
    """The batch of this step was shipped already; shipped batches are never rewritten."""


def temp_name(name: str) -> str:
    """A fresh hidden temp name to build `name` under: `.tmp-<name>-<8 hex digits>`."""
    return f"{TEMP_PREFIX}{name}-{secrets.token_hex(4)}"


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the names created or renamed in it are durable.

    Raises OSError when the directory cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, buffers: Sequence[np.ndarray], *, fsync: bool = True) -> int:
    """Create `path` (it must not exist) holding `buffers` (uint8 arrays) back to back,
    fsynced before it is closed unless `fsync` is false; return the bytes written.

    The buffers go to the file with writev(2), at most IOV_MAX per call, resuming after a
    short write: a writer hands over its arrays' own memory and never joins them.

    Raises FileExistsError when `path` exists, OSError on any other failure (the partial
    file is left for the caller to remove).
    """
    pending = [buffer for buffer in buffers if buffer.nbytes]
    size = sum(buffer.nbytes for buffer in pending)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, pending)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size


def write_file_synced(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Create `path` (it must not exist) with `data`, fsynced before it is closed.

    Raises FileExistsError when `path` exists, OSError on any other failure.
    """
    write_new_file(path, [np.frombuffer(data, dtype=np.uint8)], fsync=fsync)


def _write_all(fd: int, buffers: list[np.ndarray]) -> None:
    """Write every buffer in order with writev(2), at most `_IOV_MAX` per call, resuming
    after a short write."""
    first = 0
    while first < len(buffers):
        # ndarrays export the buffer protocol; numpy's type stubs do not say so.
        written = os.writev(fd, buffers[first : first + _IOV_MAX])  # type: ignore[arg-type]
        if written <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while written:
            head = buffers[first]
            if written >= head.nbytes:
                written -= head.nbytes
                first += 1
            else:
                buffers[first] = head[written:]
                written = 0


def replace_file_atomically(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to `path` so that readers see the old content or the new, never a mix.

    The bytes go to a hidden temp file in the same directory, which is fsynced and then
    renamed over `path`; the directory is fsynced last so the rename survives a crash.
    The temp file is removed when anything fails. Raises OSError.
    """
    temp = path.with_name(temp_name(path.name))
    try:
        write_file_synced(temp, data, fsync=fsync)
        temp.replace(path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def publish_step_dir(final_dir: Path, fill: Callable[[Path], None], *, fsync: bool = True) -> None:
    """Publish a step directory atomically: `fill` writes its files into a hidden temp
    directory beside `final_dir`, which is fsynced, renamed to `final_dir`, and its parent
    fsynced (with `fsync=False` the fsyncs are skipped). Blocking.

    rename(2) replaces an *empty* directory but fails on a non-empty one, and a shipped
    step is never empty, so a concurrent publisher loses here: `BatchExists`. On any
    failure the temp directory is removed; a crash leaves at most a `.tmp-*` directory.
    """
    parent = final_dir.parent
    temp_dir = parent / temp_name(final_dir.name)
    temp_dir.mkdir()
    try:
        fill(temp_dir)
        if fsync:
            fsync_dir(temp_dir)
        try:
            temp_dir.rename(final_dir)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise BatchExists(errno.EEXIST, "step already shipped", str(final_dir)) from None
            raise
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    if fsync:
        fsync_dir(parent)


def remove_partial_batches(batches_dir: Path) -> int:
    """Delete the `.tmp-*` leftovers of publishes cut short by a crash; return how many.

    Call it only while no publish is running (at start-up, before shipping). Never
    follows a symlink: a link named `.tmp-*` is unlinked, not entered. A missing
    `batches_dir` means none. Raises OSError when something cannot be deleted.
    """
    removed = 0
    try:
        entries = list(os.scandir(batches_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PARTIAL_BATCH_PREFIX):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            Path(entry.path).unlink(missing_ok=True)
        removed += 1
    return removed
