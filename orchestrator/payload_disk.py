"""Disk work on the payload root that the daemon does itself, always in worker threads.

- deleting the files of discarded samples (the sink decides which; this only unlinks);
- measuring the bytes on disk under the root, for the summary's peak and for `status`.

Both go through payload_gc, the one implementation of safe access to a payload root:
version directories are opened relative to the root without following a link and must
be on the root's mount, files are unlinked by name relative to them. Version directories
themselves are removed by payload_gc's collector, never here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import attrs
import trio
from payload_gc import (
    FileRemoval,
    PayloadGCError,
    RootRefused,
    parse_version,
    remove_files,
    scan_root,
)


@attrs.frozen
class Deletion:
    """What deleting a list of payload files did: files and bytes freed, and the paths
    that were refused (not inside a version directory of the root) or could not be
    deleted, as one-line problems (the first few; `problem_count` counts them all)."""

    files: int
    bytes: int
    problems: tuple[str, ...] = ()
    problem_count: int = 0


def payload_file_key(root: str, path: str) -> tuple[int, str] | None:
    """`(k, name)` for the path `<root>/v<k>/<name>` (as the daemon builds payload file
    paths), or `None` for any other path."""
    directory, _, name = path.rpartition("/")
    parent, _, version_dir = directory.rpartition("/")
    version = parse_version(version_dir)
    if parent != root or version is None or not name:
        return None
    return version, name


def unlink_files(root: Path, paths: Iterable[str]) -> Deletion:
    """Unlink each payload file (a path `<root>/v<k>/<name>`); blocking.

    A missing file is success (the version collector or another discard got there
    first). Nothing is followed: a link is removed, not its target, and a version
    directory that is a link or a mount point is refused whole.
    """
    prefix = os.fspath(root)
    keys: list[tuple[int, str]] = []
    refused: list[str] = []
    for path in paths:
        key = payload_file_key(prefix, path)
        if key is None:
            refused.append(f"{path}: not a file of a version directory of {prefix}")
        else:
            keys.append(key)
    try:
        removal = remove_files(prefix, keys)
    except PayloadGCError as exc:
        removal = FileRemoval(0, 0, (str(exc),), len(keys))
    problems = (*refused[:5], *removal.problems)
    return Deletion(removal.files, removal.bytes, problems, len(refused) + removal.problem_count)


async def delete_files(
    root: Path, paths: Iterable[str], *, limiter: trio.CapacityLimiter
) -> Deletion:
    """`unlink_files` in a worker thread."""
    batch = list(paths)
    if not batch:
        return Deletion(0, 0)
    return await trio.to_thread.run_sync(unlink_files, root, batch, limiter=limiter)


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) in the version directories of `root`, measured by payload_gc's
    scan (not following links, not entering mount points). Blocking.

    A missing or refused root holds nothing; entries that vanish while it walks (a
    concurrent collection) are skipped.
    """
    try:
        entries = scan_root(root)
    except (PayloadGCError, RootRefused):
        return 0, 0
    files = size = 0
    for entry in entries:
        if entry.version is not None and entry.usage is not None:
            files += entry.usage.files
            size += entry.usage.bytes
    return files, size


async def measure_tree(root: Path, *, limiter: trio.CapacityLimiter) -> tuple[int, int]:
    """`tree_bytes` in a worker thread."""
    return await trio.to_thread.run_sync(tree_bytes, root, limiter=limiter)
