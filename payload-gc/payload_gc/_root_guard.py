"""Refusing roots that must never be wiped or marked: `/`, home directories, links."""

from __future__ import annotations

import os
from pathlib import Path

from ._errors import RootRefused

_HOMES_PARENT = Path("/home")
_ALWAYS_REFUSED = frozenset({Path("/"), Path("/root"), _HOMES_PARENT})


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, OSError):
        return None


def dangerous_reason(root: str | os.PathLike[str]) -> str | None:
    """Why `root` (after resolving `..` and any links above it) is `/` or a home
    directory, or `None` if it is neither."""
    real = Path(os.path.realpath(root))
    if real == Path("/"):
        return "is the filesystem root /"
    if real in _ALWAYS_REFUSED or real.parent == _HOMES_PARENT or real == _home():
        return f"is a home directory ({real})"
    return None


def refuse_unsafe_root(root: str | os.PathLike[str], action: str) -> None:
    """Raise `RootRefused` if `root` is `/`, a home directory or a symbolic link;
    `action` ("wipe", "mark") names what was refused in the message."""
    # The link first: resolving it may fail where it cannot be read (sshfs refuses to read
    # an absolute link by default), and a link is refused either way.
    if Path(root).is_symlink():
        raise RootRefused(
            f"refusing to {action} payload root {root}: it is a symbolic link "
            "(pass the real directory)"
        )
    reason = dangerous_reason(root)
    if reason is not None:
        raise RootRefused(f"refusing to {action} payload root {root}: it {reason}")
