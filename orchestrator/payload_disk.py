"""Disk work on the payload root that the daemon does itself, always in worker threads.

- deleting the files of discarded samples (the sink decides which; this only unlinks);
- measuring the bytes on disk under the root, for the summary's peak and for `status`.

Version directories are removed by payload_gc, never here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

import trio


def unlink_files(paths: Iterable[str]) -> tuple[int, int]:
    """Unlink each path; return (files removed, bytes freed). Blocking.

    A missing file is success (the version collector or another discard got there
    first). `unlink` never follows a symbolic link, so a link is removed, not its target.
    """
    files = freed = 0
    for path in paths:
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue
        files += 1
        freed += size
    return files, freed


async def delete_files(paths: Iterable[str], *, limiter: trio.CapacityLimiter) -> tuple[int, int]:
    """`unlink_files` in a worker thread."""
    batch = list(paths)
    if not batch:
        return 0, 0
    return await trio.to_thread.run_sync(unlink_files, batch, limiter=limiter)


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) of regular files under `root`, not following links. Blocking.

    Entries that vanish while it walks (a concurrent collection) are skipped.
    """
    files = total = 0
    stack = [str(root)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    elif stat.S_ISREG(st.st_mode):
                        files += 1
                        total += st.st_size
        except (FileNotFoundError, NotADirectoryError):
            continue
    return files, total


async def measure_tree(root: Path, *, limiter: trio.CapacityLimiter) -> tuple[int, int]:
    """`tree_bytes` in a worker thread."""
    return await trio.to_thread.run_sync(tree_bytes, root, limiter=limiter)
