"""Busy files: files a filesystem keeps under a hidden name because they were deleted
while still open somewhere ("silly rename").

An NFS client that is asked to delete a file one of its own processes still has open
renames it to `.nfs<hex>` instead, and removes that name once the last descriptor is
closed; FUSE filesystems built on libfuse's high-level API do the same with
`.fuse_hidden<hex>`. Such a name is not ours to delete: deleting it again is refused
(`EBUSY` on NFS) or only renames it once more (FUSE), and its data is freed anyway when
the file is closed. So payload_gc never unlinks one: a directory holding nothing else is
left in place as *busy* (not a failure) and removed by a later collection, once the
files are closed and their names gone.
"""

from __future__ import annotations

import re

# Linux NFS: ".nfs" + 16 hex digits (file id) + 8 hex digits (counter); older clients
# and other systems use fewer. libfuse: ".fuse_hidden" + 8 + 8 hex digits.
_BUSY_NAME = re.compile(r"\.nfs[0-9A-Fa-f]{8,}|\.fuse_hidden[0-9A-Fa-f]{8,}")

#: How busy files are described (after how many there are, and where).
BUSY_LEFT = "deleted while still open somewhere, gone once closed"


def is_busy_name(name: str) -> bool:
    """Whether `name` is a silly-renamed file's name (`.nfs<hex>`, `.fuse_hidden<hex>`)."""
    return _BUSY_NAME.fullmatch(name) is not None


def busy_text(count: int, paths: tuple[str, ...] | list[str]) -> str:
    """`count` busy files as one line, naming the first few paths."""
    files = "1 busy file" if count == 1 else f"{count} busy files"
    shown = ", ".join(paths)
    more = count - len(paths)
    if more > 0:
        shown += f" and {more} more"
    return f"{files} ({shown}): {BUSY_LEFT}" if shown else f"{files}: {BUSY_LEFT}"
