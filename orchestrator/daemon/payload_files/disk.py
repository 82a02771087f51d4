"""Disk work on the payload root that the daemon does itself, always in worker threads.

- deleting the files of discarded samples (the sink decides which; this only unlinks, and
  `PayloadDeleter` enters it in the run's payload ledger);
- measuring the bytes on disk under the root, when asked (the end of a run's summary):
  the running daemon does not walk the root, it keeps an account of the files it knows
  (`payload_account.py`).

Both go through payload_gc, the one implementation of safe access to a payload root:
version directories are opened relative to the root without following a link and must
be on the root's mount, files are unlinked by name relative to them. Version directories
themselves are removed by payload_gc's collector, never here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import structlog
import trio
from payload_gc import (
    FileRemoval,
    PayloadGCError,
    remove_files,
    scan_root,
)

from orchestrator.daemon.payload_files.account import payload_file_key
from orchestrator.daemon.payload_files.ledger import PayloadLedger

log = structlog.get_logger(__name__)


def unlink_files(root: Path, paths: Sequence[str]) -> FileRemoval:
    """Unlink each payload file (a path `<root>/v<k>/<name>`); blocking.

    A missing file is success (the version collector or another discard got there
    first). Nothing is followed: a link is removed, not its target, and a version
    directory that is a link or a mount point is refused whole. A busy file (a
    silly-renamed name: deleted while open) is left and counted in `busy`, not as a
    problem. A path of any other form (which the daemon never builds) is refused and
    reported like those. `left` holds the `(version, name)` of every file left.
    """
    prefix = os.fspath(root)
    keys = [payload_file_key(prefix, path) for path in paths]
    refused = [
        f"{path}: not in a version directory of {prefix}"
        for path, key in zip(paths, keys, strict=True)
        if key is None
    ]
    wanted = [key for key in keys if key is not None]
    try:
        removal = remove_files(prefix, wanted)
    except PayloadGCError as exc:
        removal = FileRemoval(0, 0, (str(exc),), len(wanted), left=tuple(wanted))
    if not refused:
        return removal
    return attrs.evolve(
        removal,
        problems=(*refused[:5], *removal.problems),
        problem_count=removal.problem_count + len(refused),
    )


async def delete_files(
    root: Path, paths: Iterable[str], *, limiter: trio.CapacityLimiter
) -> FileRemoval:
    """`unlink_files` in a worker thread."""
    batch = list(paths)
    if not batch:
        return FileRemoval(0, 0)
    return await trio.to_thread.run_sync(unlink_files, root, batch, limiter=limiter)


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) in the version directories of `root`, measured by payload_gc's
    scan (not following links, not entering mount points): a walk of every file, for
    when it is asked for. Blocking.

    A missing or refused root holds nothing; entries that vanish while it walks (a
    concurrent collection) are skipped.
    """
    try:
        entries = scan_root(root)
    except PayloadGCError:
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


@attrs.frozen
class PayloadDeleter:
    """Deletes the payload files of discarded samples and swept groups, and enters what it
    did in the run's payload ledger."""

    root: Path
    ledger: PayloadLedger
    limiter: trio.CapacityLimiter

    async def delete(self, files: Sequence[str], *, reason: str) -> None:
        """Unlink `files` (in a worker thread), counted under `reason` ("discard", "sweep").
        What cannot be deleted is logged and left: a version directory that became a link
        or a mount point, or a file that cannot be unlinked; the version collector reports
        it again."""
        if not files:
            return
        removal = await delete_files(self.root, files, limiter=self.limiter)
        self.ledger.record_files_deleted(self.root, files, removal, reason=reason)
        if removal.problem_count:
            log.warning(
                "payload files not deleted",
                reason=reason,
                count=removal.problem_count,
                problems=list(removal.problems),
            )
