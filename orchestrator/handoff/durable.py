"""Crash-safe file writes for the shared filesystem: temp file, fsync, rename, fsync dir.

A reader on another host must see either nothing or the whole file, and a power loss
must not leave a name pointing at a half-written file. Whatever is written under a temp
name (a file here, a batch directory in `store`) is named by `temp_name`, so a leftover
of a write cut short by a crash is recognised by `TEMP_PREFIX`. All functions block: call
them from a worker thread in async code.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

# Every temp name starts with this, and no name that readers look for does.
TEMP_PREFIX = ".tmp-"


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


def write_file_synced(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Create `path` (it must not exist) with `data`, fsynced before it is closed.

    Raises FileExistsError when `path` exists, OSError on any other failure.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


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
