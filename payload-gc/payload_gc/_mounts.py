"""Which mount an entry is on, by mount id: the one test that catches a bind mount.

A bind mount of a directory from the same filesystem has the same `st_dev` as its parent,
so comparing devices (what `find -xdev` does) walks straight into it. The kernel gives
every mount its own id; `statx` reports it (`STATX_MNT_ID`, Linux 5.8+), and so does
`/proc/self/fdinfo/<fd>` for an open descriptor. An entry whose mount id differs from
the root's is a mount point (or lies below one): payload_gc never enters it.

Where neither source exists (another OS, an old kernel, no /proc) the id falls back to
`st_dev`, which still stops at other filesystems.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

# From <linux/stat.h> and <fcntl.h>.
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_EMPTY_PATH = 0x1000
_STATX_MNT_ID = 0x1000
# Offset of `stx_mnt_id` in `struct statx` (after mask, blksize, attributes, nlink, uid,
# gid, mode, ino, size, blocks, attributes_mask, four timestamps and four device
# numbers); the kernel writes at most 256 bytes.
_STX_MNT_ID_OFFSET = 144
_STATX_SIZE = 256


def _load_statx() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    statx.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    ]
    statx.restype = ctypes.c_int
    return statx


_statx = _load_statx()


def _statx_mount_id(dir_fd: int, name: bytes, flags: int) -> int | None:
    """The mount id from statx, or `None` when this kernel does not report one.

    Raises `OSError` for the call's own errors (e.g. `ENOENT`)."""
    if _statx is None:
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(dir_fd, name, flags, _STATX_MNT_ID, buffer) != 0:
        err = ctypes.get_errno()
        if err == 38:  # ENOSYS: a kernel without statx (or a seccomp filter)
            return None
        raise OSError(err, os.strerror(err))
    mask = int.from_bytes(buffer.raw[0:4], "little")
    if not mask & _STATX_MNT_ID:
        return None
    return int.from_bytes(buffer.raw[_STX_MNT_ID_OFFSET : _STX_MNT_ID_OFFSET + 8], "little")


def _fdinfo_mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
            for line in info:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def fd_mount_id(fd: int) -> tuple[str, int]:
    """The mount identity of open descriptor `fd`: `("mnt", id)`, or `("dev", st_dev)`
    where no mount id can be had. Two identities are equal when both entries are on the
    same mount. Raises `OSError` only from `fstat` on the fallback path."""
    mount = _statx_mount_id(fd, b"", _AT_EMPTY_PATH)
    if mount is None:
        mount = _fdinfo_mount_id(fd)
    if mount is not None:
        return ("mnt", mount)
    return ("dev", os.fstat(fd).st_dev)


def entry_mount_id(dir_fd: int, name: str) -> tuple[str, int]:
    """The mount identity of entry `name` of directory `dir_fd`, never following a link
    (a link is on its directory's mount). Raises `OSError` (e.g. the entry vanished)."""
    mount = _statx_mount_id(dir_fd, os.fsencode(name), _AT_SYMLINK_NOFOLLOW)
    if mount is not None:
        return ("mnt", mount)
    if _fdinfo_mount_id(dir_fd) is None:
        return ("dev", os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_dev)
    # No mount id from statx (none in this libc, or an old kernel), but /proc has one, as
    # `fd_mount_id` of the root does: open the entry to ask /proc too, so both sides are
    # the same kind of identity (directories only; anything else is on its directory's
    # mount).
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return fd_mount_id(dir_fd)
    try:
        return fd_mount_id(fd)
    finally:
        os.close(fd)


MountId = tuple[str, int]
