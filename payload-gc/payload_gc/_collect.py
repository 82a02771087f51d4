"""Collecting a root: delete every `v<k>` below the bound (docs/design.md §8), with a sync API for
the command line and an async one for the daemon."""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import trio

from ._audit import append_audit, utc_timestamp
from ._busy import busy_text
from ._lock import HeldLock, open_control_dir, release_and_close, try_acquire, wait_for_lock
from ._mounts import MountId, fd_mount_id
from ._plan import CollectionPlan, KeepReason, KeptEntry, PlannedDeletion, plan_collection
from ._scan import list_for_bound
from ._tree import MOUNT_POINT_LEFT, Tally, open_root, remove_tree
from ._vanished import is_vanished
from ._versions import format_bound

log = logging.getLogger("payload_gc")


@attrs.frozen
class DeletedDir:
    """A version directory (or link) that a collection removed, with what it held."""

    name: str
    version: int
    files: int
    bytes: int


@attrs.frozen
class BusyDir:
    """A version directory a collection left in place only because of busy files: files
    deleted while still open somewhere, which NFS (`.nfs<hex>`) and FUSE
    (`.fuse_hidden<hex>`) keep under a hidden name until closed. Not a failure: the
    directory is below the bound, so the next collection tries again.

    `files` and `bytes` are what was deleted from it; `busy` counts the busy files,
    `paths` names the first few (relative to the root)."""

    name: str
    version: int
    files: int
    bytes: int
    busy: int
    paths: tuple[str, ...]

    @property
    def message(self) -> str:
        return f"{busy_text(self.busy, self.paths)}; the next collection tries again"


@attrs.frozen
class CollectionError:
    """Something a collection could not delete: `name` is the direct child of the root
    it happened in (or `audit log`), `message` one line naming paths and causes."""

    name: str
    message: str


@attrs.frozen
class CollectionReport:
    """What one collection of `root` at `bound` did.

    `files` and `bytes` count everything removed, including the parts of directories that
    could not be removed entirely (those are in `errors`, or in `busy` when only busy
    files kept them: not counted as deleted, never as files).
    """

    root: str
    bound: int
    deleted: tuple[DeletedDir, ...]
    kept: tuple[KeptEntry, ...]
    errors: tuple[CollectionError, ...]
    files: int
    bytes: int
    duration_s: float
    busy: tuple[BusyDir, ...] = ()

    @property
    def dirs(self) -> int:
        return len(self.deleted)

    @property
    def outcome(self) -> str:
        """`complete`; `busy` when the only things left below the bound are directories
        holding busy files (retried by the next collection); `partial` when anything
        else could not be deleted."""
        if self.errors:
            return "partial"
        return "busy" if self.busy else "complete"


def check_workers(max_workers: int) -> None:
    """Raises `ValueError` unless `max_workers >= 1`."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")


@attrs.frozen
class _Removal:
    """The result of deleting one planned entry."""

    deletion: PlannedDeletion
    gone: bool
    tally: Tally
    #: Set when the entry turned out to be neither a directory nor a link (it stays).
    kept: KeepReason | None = None


@attrs.define
class _Session:
    """A root opened for one collection: its descriptors and (once taken) its lock."""

    root: str
    root_fd: int
    #: The root's mount identity, taken once when it is opened: nothing on another
    #: mount is entered.
    root_mount: MountId
    control_fd: int
    started: float
    started_wall: float
    lock: HeldLock | None = None

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> _Session:
        path = str(Path(root).absolute())
        root_fd = open_root(path)
        try:
            root_mount = fd_mount_id(root_fd)
            control_fd = open_control_dir(root_fd, path)
        except BaseException:
            os.close(root_fd)
            raise
        return cls(
            root=path,
            root_fd=root_fd,
            root_mount=root_mount,
            control_fd=control_fd,
            started=time.monotonic(),
            started_wall=time.time(),
        )

    def try_lock(self) -> None:
        self.lock = try_acquire(self.control_fd, self.root)
        # Time the collection from the moment it may start deleting.
        self.started = time.monotonic()
        self.started_wall = time.time()

    def plan(self, bound: int) -> CollectionPlan:
        # Only the root's listing, and a mount check of each directory to delete: no
        # kept version is entered or stat-ed (docs/design.md §8).
        entries = list_for_bound(self.root_fd, bound, root_mount=self.root_mount)
        return plan_collection(entries, bound)

    def remove(self, deletion: PlannedDeletion) -> _Removal:
        """Delete one planned entry; never raises for file-system problems."""
        tally = Tally()
        try:
            mode = os.stat(deletion.name, dir_fd=self.root_fd, follow_symlinks=False).st_mode
        except OSError as exc:
            if is_vanished(exc):
                return _Removal(deletion, gone=True, tally=tally)
            tally.problem(f"{deletion.name}: {exc.strerror}")
            return _Removal(deletion, gone=False, tally=tally)
        if stat.S_ISLNK(mode):
            # A link named like a version is unlinked, never entered; like the plan, it
            # counts as no files.
            try:
                os.unlink(deletion.name, dir_fd=self.root_fd)
            except OSError as exc:
                if not is_vanished(exc):
                    tally.problem(f"{deletion.name}: {exc.strerror}")
                    return _Removal(deletion, gone=False, tally=tally)
            return _Removal(deletion, gone=True, tally=tally)
        if not stat.S_ISDIR(mode):
            # Replaced by a file since the plan: files named like versions stay.
            return _Removal(deletion, gone=False, tally=tally, kept=KeepReason.NOT_A_DIRECTORY)
        try:
            gone = remove_tree(self.root_fd, deletion.name, deletion.name, self.root_mount, tally)
        except OSError as exc:
            # remove_tree records the problems it expects; anything else (e.g. running
            # out of file descriptors) still only fails this one directory.
            tally.problem(f"{deletion.name}: {exc.strerror or exc}")
            gone = False
        return _Removal(deletion, gone=gone, tally=tally)

    def finish(
        self, plan: CollectionPlan, removals: Iterable[_Removal], *, outcome: str | None = None
    ) -> CollectionReport:
        """Build the report and append the audit line (`outcome` overrides the report's,
        e.g. `interrupted`)."""
        report = _report(self.root, plan, removals, time.monotonic() - self.started)
        record: dict[str, object] = {
            "action": "collect",
            "time": utc_timestamp(self.started_wall),
            "root": self.root,
            "bound": plan.bound,
            "dirs": report.dirs,
            "deleted": [d.name for d in report.deleted],
            "files": report.files,
            "bytes": report.bytes,
            "duration_s": round(report.duration_s, 6),
            "outcome": outcome or report.outcome,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if report.errors:
            record["errors"] = [f"{e.name}: {e.message}" for e in report.errors]
        if report.busy:
            record["busy"] = [f"{b.name}: {b.message}" for b in report.busy]
        try:
            append_audit(self.control_fd, record)
        except OSError as exc:
            error = CollectionError("audit log", f"cannot append: {exc.strerror}")
            report = attrs.evolve(report, errors=(*report.errors, error))
        log.info(
            "collected %s below %s: %d dirs, %d files, %d bytes in %.3f s (%s)",
            self.root,
            format_bound(plan.bound),
            report.dirs,
            report.files,
            report.bytes,
            report.duration_s,
            outcome or report.outcome,
        )
        return report

    def close(self) -> None:
        lock, self.lock = self.lock, None
        release_and_close(lock, self.control_fd, self.root_fd)


def _report(
    root: str, plan: CollectionPlan, removals: Iterable[_Removal], duration_s: float
) -> CollectionReport:
    deleted: list[DeletedDir] = []
    busy: list[BusyDir] = []
    kept = list(plan.keep)
    # A mount point below the bound stays (never entered): the root is not fully
    # collected, so it counts as an error like a directory that could not be deleted.
    errors = [
        (k.version or 0, CollectionError(k.name, MOUNT_POINT_LEFT))
        for k in plan.keep
        if k.reason is KeepReason.MOUNT_POINT
    ]
    files = size = 0
    for removal in sorted(removals, key=lambda r: r.deletion.version):
        d, tally = removal.deletion, removal.tally
        files += tally.files
        size += tally.bytes
        if removal.gone:
            deleted.append(DeletedDir(d.name, d.version, tally.files, tally.bytes))
        elif removal.kept is not None:
            kept.append(KeptEntry(d.name, removal.kept, d.version, None))
        elif tally.busy_count and not tally.problem_count:
            paths = tuple(tally.busy_paths)
            busy.append(
                BusyDir(d.name, d.version, tally.files, tally.bytes, tally.busy_count, paths)
            )
        if tally.problem_count:
            errors.append((d.version, CollectionError(d.name, tally.summary())))
    return CollectionReport(
        root=root,
        bound=plan.bound,
        deleted=tuple(deleted),
        kept=tuple(kept),
        errors=tuple(e for _, e in sorted(errors, key=lambda ve: ve[0])),
        files=files,
        bytes=size,
        duration_s=duration_s,
        busy=tuple(busy),
    )


def collect_below_sync(
    root: str | os.PathLike[str], bound: int, *, max_workers: int = 4
) -> CollectionReport:
    """Delete every direct child `v<k>` of `root` with `k < bound`, in up to
    `max_workers` threads (one version directory per thread at a time).

    Follows the rules of docs/design.md §8: only the root is listed (no kept version is
    entered or stat-ed), no symbolic link is followed (a link named like a version is
    unlinked), no mount point is entered (another filesystem or a bind mount of the
    root's own, told apart by mount id), missing files count as deleted, and one audit
    line is appended. A directory that cannot be deleted entirely (e.g. permission
    denied, or a mount point inside it) and a `v<k>` below the bound that is itself a
    mount point (left in place) are reported in `errors` (outcome `partial`); a
    directory left only because it holds busy files (deleted while open: `.nfs<hex>`,
    `.fuse_hidden<hex>`) is reported in `busy` (outcome `busy`), not as an error; the
    rest is still collected.

    Raises `RootMissing`, `RootRefused` (a symbolic link or not a directory), `LockHeld`
    (another collector is running: this call does not wait), `PayloadGCError` (the
    control directory cannot be created), `ValueError` for `max_workers < 1`.
    """
    check_workers(max_workers)
    session = _Session.open(root)
    try:
        session.try_lock()
        plan = session.plan(bound)
        with ThreadPoolExecutor(max_workers, thread_name_prefix="payload-gc") as pool:
            removals = list(pool.map(session.remove, plan.delete))
        return session.finish(plan, removals)
    finally:
        session.close()


async def collect_below(
    root: str | os.PathLike[str], bound: int, *, max_workers: int = 4
) -> CollectionReport:
    """The async twin of `collect_below_sync`, for a trio program: every file-system call
    runs in a worker thread (at most `max_workers` deleting at once), so the event loop
    keeps running however many files go.

    If another collector holds the lock, this waits for it (polling), cancellably: put
    the deadline at the call site, e.g. `with trio.fail_after(60):`. If cancelled while
    deleting, the directories already being deleted are finished and an audit line with
    outcome `interrupted` is written.

    Raises what `collect_below_sync` raises, except `LockHeld`.
    """
    check_workers(max_workers)
    session = await trio.to_thread.run_sync(_Session.open, root)
    try:
        await wait_for_lock(session.try_lock)
        plan = await trio.to_thread.run_sync(session.plan, bound)
        limiter = trio.CapacityLimiter(max_workers)
        removals: list[_Removal] = []

        async def remove(deletion: PlannedDeletion) -> None:
            removals.append(
                await trio.to_thread.run_sync(session.remove, deletion, limiter=limiter)
            )

        finished = False
        try:
            async with trio.open_nursery() as nursery:
                for deletion in plan.delete:
                    nursery.start_soon(remove, deletion)
            finished = True
        finally:
            if not finished:
                # Cancelled (or failed) midway: still record what was deleted.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        lambda: session.finish(plan, removals, outcome="interrupted")
                    )
        return await trio.to_thread.run_sync(session.finish, plan, removals)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(session.close)
