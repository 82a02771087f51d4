"""Start-up of a fresh run (docs/design.md §7): wipe the payload root and mark it as one."""

from __future__ import annotations

import errno
import functools
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import trio

from ._audit import append_audit, utc_timestamp
from ._busy import is_busy_name
from ._collect import CollectionError, check_workers
from ._errors import PayloadGCError, RootRefused
from ._layout import CONTROL_NAMES, MARKER_NAME
from ._lock import HeldLock, open_control_dir, release_and_close, try_acquire, wait_for_lock
from ._mounts import MountId, fd_mount_id
from ._plan import EntryKind, KeepReason, RootEntry, plan_collection, unmarked_root_refusal
from ._root_guard import refuse_unsafe_root
from ._scan import list_root
from ._tree import Tally, open_root, remove_tree

# O_NONBLOCK: opening a FIFO planted under the marker's name fails instead of hanging.
_MARKER_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@attrs.frozen
class WipeReport:
    """What a wipe removed from `root`: `entries` direct children, holding `files` files
    and `bytes` bytes. `kept` names children left in place (mount points, never entered:
    another filesystem or a bind mount of the root's own), `errors` what could not be
    removed, `busy` what was left only because of busy files (deleted while open and
    silly-renamed, `.nfs<hex>`/`.fuse_hidden<hex>`: one line per child, `name: why`; not
    a failure, they go once closed), `created` whether the root was created because it
    did not exist."""

    root: str
    entries: int
    files: int
    bytes: int
    kept: tuple[str, ...]
    errors: tuple[CollectionError, ...]
    duration_s: float
    created: bool
    busy: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        """`complete`; `busy` when only busy files (and the directories holding them) are
        left; `partial` when anything else could not be removed."""
        if self.errors:
            return "partial"
        return "busy" if self.busy else "complete"


def _write_marker(root_fd: int, root: str) -> None:
    label = f"{root}/{MARKER_NAME}"
    try:
        fd = os.open(MARKER_NAME, _MARKER_FLAGS, 0o644, dir_fd=root_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise RootRefused(f"{label} exists and is not a regular file; remove it") from None
        raise PayloadGCError(f"cannot write {label}: {exc.strerror}") from None
    try:
        if os.fstat(fd).st_size == 0:
            text = (
                "This directory is a payload root: payload-gc may delete everything in it.\n"
                f"Marked {utc_timestamp(time.time())} by pid {os.getpid()} "
                f"on {socket.gethostname()}.\n"
            )
            os.write(fd, text.encode())
    finally:
        os.close(fd)


def _make_root(root: str, action: str) -> bool:
    """Refuse an unsafe root, create it if missing; return whether it was created."""
    refuse_unsafe_root(root, action)
    if os.path.lexists(root):
        return False
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PayloadGCError(f"cannot create payload root {root}: {exc.strerror}") from None
    return True


def init_root(root: str | os.PathLike[str]) -> None:
    """Create `root` if needed and write its `.payload-root` marker (kept if present), so
    that `wipe_root` and the `payload-gc` command accept it.

    Raises `RootRefused` for `/`, a home directory, a symbolic link, or a marker that is
    not a regular file; `PayloadGCError` if the root cannot be created or written.
    """
    path = str(Path(root).absolute())
    _make_root(path, "mark")
    root_fd = open_root(path)
    try:
        _write_marker(root_fd, path)
    finally:
        os.close(root_fd)


@attrs.define
class _Wipe:
    root: str
    root_fd: int
    #: The root's mount identity, taken once when it is opened.
    root_mount: MountId
    entries: list[RootEntry]
    created: bool
    control_fd: int = -1
    lock: HeldLock | None = None

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> _Wipe:
        path = str(Path(root).absolute())
        created = _make_root(path, "wipe")
        root_fd = open_root(path)
        try:
            root_mount = fd_mount_id(root_fd)
            entries = list_root(root_fd, measure=False, root_mount=root_mount)
            # Any bound will do: a wipe's refusal only asks what is not payload_gc's own.
            refusal = unmarked_root_refusal(path, plan_collection(entries, 0), wipe=True)
            if refusal is not None:
                raise RootRefused(refusal)
            control_fd = open_control_dir(root_fd, path)
        except BaseException:
            os.close(root_fd)
            raise
        return cls(path, root_fd, root_mount, entries, created, control_fd)

    def try_lock(self) -> None:
        self.lock = try_acquire(self.control_fd, self.root)

    def run(self, max_workers: int) -> WipeReport:
        started, started_wall = time.monotonic(), time.time()
        # The marker stays in place throughout: a wipe interrupted midway leaves a root
        # that the next wipe still accepts.
        # Busy files directly in the root are not ours to delete (see _busy.py).
        busy_files = sorted(
            e.name
            for e in self.entries
            if e.kind is not EntryKind.DIRECTORY and is_busy_name(e.name)
        )
        doomed = [
            e
            for e in self.entries
            if e.name not in CONTROL_NAMES and e.same_filesystem and e.name not in busy_files
        ]
        kept = tuple(sorted(e.name for e in self.entries if not e.same_filesystem))

        def remove(entry: RootEntry) -> tuple[RootEntry, bool, Tally]:
            tally = Tally()
            gone = remove_tree(self.root_fd, entry.name, entry.name, self.root_mount, tally)
            return entry, gone, tally

        with ThreadPoolExecutor(max_workers, thread_name_prefix="payload-gc") as pool:
            results = list(pool.map(remove, doomed))
        errors = tuple(
            CollectionError(e.name, tally.summary())
            for e, _, tally in results
            if tally.problem_count
        )
        busy = tuple(
            [f"{name}: {KeepReason.BUSY.value}" for name in busy_files]
            + [
                f"{e.name}: {tally.busy_summary()}"
                for e, gone, tally in results
                if not gone and tally.busy_count and not tally.problem_count
            ]
        )
        report = WipeReport(
            root=self.root,
            entries=sum(gone for _, gone, _ in results),
            files=sum(t.files for _, _, t in results),
            bytes=sum(t.bytes for _, _, t in results),
            kept=kept,
            errors=errors,
            duration_s=time.monotonic() - started,
            created=self.created,
            busy=busy,
        )
        record: dict[str, object] = {
            "action": "wipe",
            "time": utc_timestamp(started_wall),
            "root": self.root,
            "entries": report.entries,
            "files": report.files,
            "bytes": report.bytes,
            "duration_s": round(report.duration_s, 6),
            "outcome": report.outcome,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if errors:
            record["errors"] = [f"{e.name}: {e.message}" for e in errors]
        if kept:
            record["kept"] = list(kept)
        if busy:
            record["busy"] = list(busy)
        try:
            append_audit(self.control_fd, record)
        except OSError as exc:
            report = attrs.evolve(
                report,
                errors=(*errors, CollectionError("audit log", f"cannot append: {exc.strerror}")),
            )
        _write_marker(self.root_fd, self.root)
        return report

    def close(self) -> None:
        lock, self.lock = self.lock, None
        release_and_close(lock, self.control_fd, self.root_fd)


def wipe_root(root: str | os.PathLike[str], *, max_workers: int = 4) -> WipeReport:
    """Delete everything inside `root` (creating it if missing), then write its
    `.payload-root` marker: the start of a fresh run.

    The same rules as a collection apply: links are unlinked, never followed; mount
    points are kept and reported; busy files (deleted while open) are left, and with
    them their directories, reported in `busy` rather than as errors; deletion runs in
    up to `max_workers` threads; the collector's lock is held and one audit line is
    appended. The marker and the `.payload-gc` directory (lock and audit log) stay.

    Raises `RootRefused` for `/`, a home directory (`Path.home()`, `/home/*`, `/root`), a
    symbolic link, or a non-empty directory without the marker; `LockHeld` if a
    collector is running; `PayloadGCError` if the root cannot be created or opened;
    `ValueError` for `max_workers < 1`.
    """
    check_workers(max_workers)
    wipe = _Wipe.open(root)
    try:
        wipe.try_lock()
        return wipe.run(max_workers)
    finally:
        wipe.close()


async def wipe_root_async(root: str | os.PathLike[str], *, max_workers: int = 4) -> WipeReport:
    """The async twin of `wipe_root`: all file-system work runs in worker threads, and a
    held lock is waited for (cancellably) instead of raising `LockHeld`. Once deletion
    has started it runs to completion even if cancelled.

    Raises what `wipe_root` raises, except `LockHeld`.
    """
    check_workers(max_workers)
    wipe = await trio.to_thread.run_sync(_Wipe.open, root)
    try:
        await wait_for_lock(wipe.try_lock)
        return await trio.to_thread.run_sync(functools.partial(wipe.run, max_workers))
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(wipe.close)
