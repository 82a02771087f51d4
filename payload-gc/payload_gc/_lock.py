"""One collector at a time per root: the lock file `<root>/.payload-gc/lock`.

The lock is a file holding the owner's host, pid and start time, made exclusively
(atomic on local filesystems and NFS alike, unlike `flock`, which some cluster filesystems
do not support). The owner is written first, into a file of the collector's own
(`lock.new-<hex>`), which is then hard-linked as `lock`: the link fails if the lock
exists, and a collector killed at any moment leaves either no lock or one that names
it, never an empty one that nobody could prove stale. On a filesystem without hard links
the lock is created with `O_EXCL` and written after. A lock left by a process that died on
this host is stale and taken over; a lock from another host cannot be checked and is
reported.

The lock prevents duplicate work and interleaved audit lines; deletion itself stays
correct without it, because a missing file counts as deleted.

Nothing of the collector's own is left in the control directory: every descriptor on a
file of ours is closed before that file is unlinked (a file unlinked while open would
stay behind on NFS and FUSE as a busy `.nfs*`/`.fuse_hidden*` file), a stale lock moved
aside, or a lock being made, is removed by whoever made it, and one left by a collector
that died in between is removed by the next holder of the lock. Busy files in the
control directory (another process's, still open) are left alone: their filesystem
removes them once closed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from ._errors import LockHeld, PayloadGCError
from ._layout import CONTROL_DIR_NAME, LOCK_NAME
from ._tree import DIR_FLAGS
from ._vanished import is_vanished

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
log = logging.getLogger("payload_gc")

#: The async APIs poll a held lock this often at first, backing off to the maximum.
LOCK_POLL_INITIAL_S = 0.05
LOCK_POLL_MAX_S = 1.0
#: Attempts at creating the lock when a stale one was just removed under us.
_ATTEMPTS = 3
#: A lock file this young that holds no owner (empty or partial) is most likely being
#: written by a collector that is just starting: it is reported as such, never as one to
#: delete.
STARTING_GRACE_S = 10.0
#: A stale lock moved aside (`lock.stale-<hex>`) is removed by the collector that moved
#: it within microseconds; one this old (by its change time) was left by a collector
#: that died in between, and is removed by the next holder of the lock.
ASIDE_GRACE_S = 60.0
_ASIDE_PREFIX = f"{LOCK_NAME}.stale-"
#: A lock being made: the owner written here first, then linked as the lock.
_NEW_PREFIX = f"{LOCK_NAME}.new-"
#: What `link` raises where a filesystem has no hard links (FAT, some FUSE and object
#: stores): the lock is then created in place with `O_EXCL`.
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK})


@attrs.frozen
class LockOwner:
    """Who holds a lock. `boot_id` and `start_ticks` (Linux only) tell a live owner from
    a reused pid or a previous boot; `token` tells two owners in one process apart."""

    host: str
    pid: int
    time: float
    token: str
    boot_id: str | None = None
    start_ticks: int | None = None

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes) -> LockOwner | None:
        """Parse a lock file's content; `None` if it is not a lock we wrote."""
        try:
            data = json.loads(raw)
            owner = cls(
                host=str(data["host"]),
                pid=int(data["pid"]),
                time=float(data["time"]),
                token=str(data["token"]),
                boot_id=None if data.get("boot_id") is None else str(data["boot_id"]),
                start_ticks=None if data.get("start_ticks") is None else int(data["start_ticks"]),
            )
        except (ValueError, TypeError, KeyError):
            return None
        # pid 0 or negative would make os.kill address a process group.
        return owner if owner.pid > 0 else None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        # The command name (field 2) may hold spaces and parentheses: split after it.
        return int(raw[raw.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def current_owner() -> LockOwner:
    pid = os.getpid()
    return LockOwner(
        host=socket.gethostname(),
        pid=pid,
        time=time.time(),
        token=secrets.token_hex(8),
        boot_id=_boot_id(),
        start_ticks=_start_ticks(pid),
    )


def _is_stale(owner: LockOwner) -> bool:
    """Whether the process that wrote this lock is certainly gone (only decidable for a
    process of this host)."""
    if owner.host != socket.gethostname():
        return False
    if owner.boot_id is not None and owner.boot_id != _boot_id():
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    # Alive, unless the pid was reused by a younger process.
    ticks = _start_ticks(owner.pid)
    return owner.start_ticks is not None and ticks is not None and ticks != owner.start_ticks


@attrs.define
class HeldLock:
    """The lock this process holds on a root; `release` it exactly once."""

    control_fd: int
    owner: LockOwner

    def release(self) -> None:
        """Remove the lock file if it is still ours (a lock broken as stale by mistake
        and re-taken by another collector is left alone). The file is read through a
        descriptor that is closed again before the unlink."""
        raw = _read(self.control_fd, LOCK_NAME)
        held = None if raw is None else LockOwner.from_json(raw)
        if held is not None and held.token == self.owner.token:
            _unlink_gone_or_not(self.control_fd, LOCK_NAME)


def release_and_close(lock: HeldLock | None, *fds: int) -> None:
    """End a session on a root: release its lock (if it took one), then close its
    descriptors, even when releasing fails."""
    try:
        if lock is not None:
            lock.release()
    finally:
        for fd in fds:
            os.close(fd)


def open_control_dir(root_fd: int, root: str) -> int:
    """Open (creating it if needed) `<root>/.payload-gc`, refusing anything but a plain
    directory there. Raises `PayloadGCError` with a one-line message."""
    label = f"{root}/{CONTROL_DIR_NAME}"
    try:
        os.mkdir(CONTROL_DIR_NAME, 0o755, dir_fd=root_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PayloadGCError(f"cannot create {label}: {exc.strerror}") from None
    try:
        return os.open(CONTROL_DIR_NAME, DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        raise PayloadGCError(f"cannot open {label} as a directory: {exc.strerror}") from None


def _read(dir_fd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if is_vanished(exc):
            return None
        raise
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def try_acquire(control_fd: int, root: str) -> HeldLock:
    """Take the lock of `root` (its control directory open as `control_fd`) once.

    A stale lock (its process died on this host) is taken over, with a warning naming who
    held it and since when. Raises `LockHeld` naming
    the holder if another live collector (or one on another host) holds it, and
    `PayloadGCError` if the lock file cannot be written.
    """
    for _ in range(_ATTEMPTS):
        owner = current_owner()
        try:
            _make_lock(control_fd, owner)
        except FileExistsError:
            raw = _read(control_fd, LOCK_NAME)
            if raw is None:
                continue  # released meanwhile: try again
            holder = LockOwner.from_json(raw)
            if holder is not None and holder.token == owner.token:
                # Ours: the link was made but reported as failed (an NFS call retried
                # after its reply was lost finds the name taken).
                _remove_left_asides(control_fd)
                return HeldLock(control_fd, owner)
            if holder is not None and _is_stale(holder):
                _break_stale(control_fd, raw)
                log.warning(
                    "took over the stale lock of %s: pid %d on %s held it since %s and is gone",
                    root,
                    holder.pid,
                    holder.host,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.time)),
                )
                continue
            raise _held_error(control_fd, root, holder) from None
        except OSError as exc:
            raise PayloadGCError(
                f"cannot create lock {root}/{CONTROL_DIR_NAME}/{LOCK_NAME}: {exc.strerror}"
            ) from None
        _remove_left_asides(control_fd)
        return HeldLock(control_fd, owner)
    raise _held_error(control_fd, root, None)


def _make_lock(control_fd: int, owner: LockOwner) -> None:
    """Create the lock naming `owner`, or raise FileExistsError if there is one.

    The owner goes into `lock.new-<token>` first, which is then linked as the lock and
    unlinked (its descriptor closed before either). Where `link` is not supported the lock
    is created with `O_EXCL` and written, as the fallback (a kill between the two leaves
    an empty lock, reported by `_held_error`).
    """
    content = (owner.to_json() + "\n").encode()
    new = f"{_NEW_PREFIX}{owner.token}"
    _write_new(control_fd, new, content)
    try:
        os.link(new, LOCK_NAME, src_dir_fd=control_fd, dst_dir_fd=control_fd, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        _write_new(control_fd, LOCK_NAME, content)
    finally:
        _unlink_gone_or_not(control_fd, new)


def _unlink_gone_or_not(control_fd: int, name: str) -> None:
    """Unlink `name` from the control directory; one already gone is fine."""
    try:
        os.unlink(name, dir_fd=control_fd)
    except OSError as exc:
        if not is_vanished(exc):
            raise


def _write_new(control_fd: int, name: str, content: bytes) -> None:
    """Create `name` exclusively in the control directory and write `content` to it.
    Raises FileExistsError when it exists."""
    fd = os.open(name, _CREATE_FLAGS, 0o644, dir_fd=control_fd)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)


def _remove_left_asides(control_fd: int) -> None:
    """Remove stale locks moved aside, and locks being made, by a collector that died
    before removing them (older than `ASIDE_GRACE_S`). Called holding the lock; never
    raises. Nothing else in the control directory is touched: not the audit log, and not
    busy files."""
    try:
        names = os.listdir(control_fd)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not name.startswith((_ASIDE_PREFIX, _NEW_PREFIX)):
            continue
        try:
            st = os.stat(name, dir_fd=control_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and now - st.st_ctime > ASIDE_GRACE_S:
                os.unlink(name, dir_fd=control_fd)
        except OSError:
            continue


def _break_stale(control_fd: int, stale: bytes) -> None:
    """Remove a stale lock whose content was `stale`, without removing a live lock that
    another collector may have put in its place since we read it."""
    aside = f"{_ASIDE_PREFIX}{secrets.token_hex(8)}"
    try:
        os.rename(LOCK_NAME, aside, src_dir_fd=control_fd, dst_dir_fd=control_fd)
    except OSError as exc:
        if is_vanished(exc):
            return
        raise
    try:
        # `_read` has closed the file again before it is unlinked below.
        if _read(control_fd, aside) != stale:
            # We moved a fresh lock: put it back unless a third collector already
            # created one (then two hold it; harmless, see the module docstring), or the
            # next holder removed it as left over.
            try:
                os.link(aside, LOCK_NAME, src_dir_fd=control_fd, dst_dir_fd=control_fd)
            except OSError as exc:
                if not (isinstance(exc, FileExistsError) or is_vanished(exc)):
                    raise
    finally:
        _unlink_gone_or_not(control_fd, aside)


def _held_error(control_fd: int, root: str, holder: LockOwner | None) -> LockHeld:
    path = f"{root}/{CONTROL_DIR_NAME}/{LOCK_NAME}"
    if holder is None:
        try:
            # Clamped: a file server's clock may run ahead of ours.
            age = max(0.0, time.time() - os.stat(LOCK_NAME, dir_fd=control_fd).st_mtime)
        except OSError:
            age = 0.0  # gone meanwhile: a retry will find it free or written
        if age < STARTING_GRACE_S:
            message = (
                f"payload root {root} is locked ({path}): another collector is starting "
                "and still writing its lock; retry in a few seconds"
            )
        else:
            message = (
                f"payload root {root} is locked ({path}), but the lock file names no "
                f"holder (empty or unreadable) and is {age:.0f} s old; first make sure no "
                "collector runs on any host that uses this root, then delete the file"
            )
        return LockHeld(message, host=None, pid=None, age_s=age)
    age = max(0.0, time.time() - holder.time)
    return LockHeld(
        f"payload root {root} is locked by pid {holder.pid} on {holder.host} "
        f"for {age:.0f} s ({path}); retry later, or delete the file if that process is gone",
        host=holder.host,
        pid=holder.pid,
        age_s=age,
    )


async def wait_for_lock(try_lock: Callable[[], None]) -> None:
    """Call the blocking `try_lock` in a worker thread until it stops raising `LockHeld`,
    sleeping between attempts (cancellable; the caller sets the deadline)."""
    delay = LOCK_POLL_INITIAL_S
    waiting = False
    while True:
        try:
            await trio.to_thread.run_sync(try_lock)
        except LockHeld as exc:
            if not waiting:
                log.warning("waiting for the lock: %s", exc)
                waiting = True
            await trio.sleep(delay)
            delay = min(delay * 2, LOCK_POLL_MAX_S)
        else:
            return
