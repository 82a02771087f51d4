"""What "it vanished" means: the one test payload_gc (and the daemon and trainer on top of
it) applies to an `OSError` from a call on an entry someone else may have removed.

`ENOENT` on any filesystem. `ESTALE` as well on network and FUSE filesystems: an entry
another process or host removed may still be known to this client by its file handle
(NFS) or node (FUSE: sshfs and the like), and a call on it, or on a name relative to an
open descriptor of a directory that was removed, fails with "Stale file handle" rather
than "No such file or directory". Either way the entry is gone.

Used only where an entry is reached through an open descriptor (a name relative to an
open directory, or the open directory itself). A full path looked up from scratch is
retried by the kernel when it meets a stale handle, so an `ESTALE` that still comes back
from one (the payload root's own path) says the mount is broken, not that the entry was
deleted: `open_root` reports it as an error.
"""

from __future__ import annotations

import errno

#: The error numbers that mean an entry is gone (see the module's docstring).
VANISHED_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})


def is_vanished(exc: OSError) -> bool:
    """Whether `exc` says that the entry it was raised for no longer exists: removed by
    someone else (`ENOENT`, or `ESTALE` on NFS and FUSE mounts)."""
    return exc.errno in VANISHED_ERRNOS
