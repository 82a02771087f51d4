"""The collection plan: which direct children of a root go, and why the others stay.

Pure logic over a listing of the root (`RootEntry` values); `_scan.py` produces the
listing from a real directory. `unmarked_root_refusal` is the one rule, and the one
message, for a root that may not be a payload root at all.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from ._busy import is_busy_name
from ._layout import CONTROL_NAMES, MARKER_NAME
from ._versions import is_noncanonical_version, parse_version


class EntryKind(enum.Enum):
    """What a directory entry is, seen without following symbolic links."""

    DIRECTORY = "directory"
    SYMLINK = "symlink"
    FILE = "file"
    #: A FIFO, socket or device node.
    OTHER = "other"


class KeepReason(enum.Enum):
    """Why a direct child of the root stays. The value is the text shown to people."""

    AT_OR_ABOVE_BOUND = "at or above the bound"
    NOT_A_VERSION = "name is not v<digits>"
    #: `v010`, `v00`: digits, but not the one spelling writers use for a version.
    NOT_CANONICAL = "not a canonical version name (v<k> without leading zeros)"
    NOT_A_DIRECTORY = "named like a version but not a directory"
    CONTROL = "payload-gc control entry"
    #: A file deleted while still open, kept by its filesystem under a hidden name
    #: (`.nfs<hex>`, `.fuse_hidden<hex>`) until closed: not ours to delete.
    BUSY = "busy: deleted while open, removed by its filesystem once closed"
    #: A mount point (another filesystem, or a bind mount of the root's own): never
    #: entered. A real collection reports it as an error, since it stays below the bound.
    MOUNT_POINT = "mount point (not entered)"


@attrs.frozen
class Usage:
    """Files and bytes below a directory: `files` counts every non-directory entry but
    busy files, `bytes` their apparent sizes (`st_size`), `busy` the busy files
    (deleted while open and silly-renamed: a collection leaves them, and with them the
    directory, until they are closed)."""

    files: int
    bytes: int
    busy: int = 0


@attrs.frozen
class RootEntry:
    """One direct child of a payload root.

    `same_filesystem` is false for a mount point: an entry on another mount than the
    root's (another filesystem, or a bind mount of the same one). `usage` is what the
    directory holds, `Usage(0, 0)` for a symbolic link (never entered), and `None` when
    not measured.
    """

    name: str
    kind: EntryKind
    same_filesystem: bool = True
    usage: Usage | None = None

    @property
    def version(self) -> int | None:
        return parse_version(self.name)


@attrs.frozen
class PlannedDeletion:
    """A version directory (or a symbolic link with a version's name) that goes."""

    name: str
    version: int
    kind: EntryKind
    usage: Usage | None


@attrs.frozen
class KeptEntry:
    """A direct child of the root that stays, with the reason."""

    name: str
    reason: KeepReason
    version: int | None
    usage: Usage | None


@attrs.frozen
class CollectionPlan:
    """Everything a collection at `bound` would do to one root.

    `delete` is sorted by version, `keep` by version first and then by name. `marked`
    says whether the root holds the `.payload-root` marker file.
    """

    bound: int
    delete: tuple[PlannedDeletion, ...]
    keep: tuple[KeptEntry, ...]
    marked: bool

    @property
    def files(self) -> int:
        """Files the deletions hold (0 for unmeasured ones)."""
        return sum(d.usage.files for d in self.delete if d.usage is not None)

    @property
    def bytes(self) -> int:
        """Bytes the deletions hold (0 for unmeasured ones)."""
        return sum(d.usage.bytes for d in self.delete if d.usage is not None)

    @property
    def foreign(self) -> tuple[str, ...]:
        """Names of entries that are neither version directories nor payload_gc's own
        (non-canonical names like `v010` included): a root holding such entries and no
        marker may not be a payload root at all."""
        return tuple(
            k.name
            for k in self.keep
            if k.reason
            in (KeepReason.NOT_A_VERSION, KeepReason.NOT_CANONICAL, KeepReason.NOT_A_DIRECTORY)
        )


def keep_reason(entry: RootEntry, bound: int) -> KeepReason | None:
    """Why `entry` stays in a collection at `bound`, or `None` if it is deleted.

    Only a direct child named `v<k>` (canonical spelling) with `k < bound` goes, and only
    if it is a directory on the root's filesystem or a symbolic link (unlinked, never
    followed). A regular file named `v3` stays: the collector removes what writers
    create, version directories, and nothing else.
    """
    if entry.name in CONTROL_NAMES:
        return KeepReason.CONTROL
    if entry.kind is not EntryKind.DIRECTORY and is_busy_name(entry.name):
        return KeepReason.BUSY
    version = entry.version
    if version is None:
        if is_noncanonical_version(entry.name):
            return KeepReason.NOT_CANONICAL
        return KeepReason.NOT_A_VERSION
    if version >= bound:
        return KeepReason.AT_OR_ABOVE_BOUND
    if entry.kind is EntryKind.SYMLINK:
        return None
    if entry.kind is not EntryKind.DIRECTORY:
        return KeepReason.NOT_A_DIRECTORY
    if not entry.same_filesystem:
        return KeepReason.MOUNT_POINT
    return None


def _keep_order(kept: KeptEntry) -> tuple[int, int, str]:
    # Versions first in numeric order (v2 before v10), then every other name.
    if kept.version is None:
        return (1, 0, kept.name)
    return (0, kept.version, kept.name)


def plan_collection(entries: Iterable[RootEntry], bound: int) -> CollectionPlan:
    """Decide, without touching any file, what a collection at `bound` deletes.

    `entries` are the root's direct children. A negative bound deletes nothing.
    """
    delete: list[PlannedDeletion] = []
    keep: list[KeptEntry] = []
    marked = False
    for entry in entries:
        if entry.name == MARKER_NAME and entry.kind is EntryKind.FILE:
            marked = True
        reason = keep_reason(entry, bound)
        if reason is None:
            # keep_reason only deletes entries whose name parsed as a version.
            assert entry.version is not None
            delete.append(PlannedDeletion(entry.name, entry.version, entry.kind, entry.usage))
        else:
            keep.append(KeptEntry(entry.name, reason, entry.version, entry.usage))
    delete.sort(key=lambda d: d.version)
    keep.sort(key=_keep_order)
    return CollectionPlan(bound=bound, delete=tuple(delete), keep=tuple(keep), marked=marked)


def unmarked_root_refusal(root: str, plan: CollectionPlan, *, wipe: bool = False) -> str | None:
    """Why `root` may not be a payload root at all (a mistyped root, a home directory), or
    `None` when it may be one. The one rule for every command and the wipe.

    A root with the `.payload-root` marker is a payload root. Without it, a collection
    refuses a root holding entries that are not version directories (`plan.foreign`);
    a wipe (`wipe=True`), which deletes everything, refuses a root holding any entry but
    payload_gc's own and busy files. The reason is one line naming an example entry and
    how to mark the root if it really is one. `plan` may be of any bound, measured or
    not.
    """
    if plan.marked:
        return None
    if wipe:
        # Everything a wipe would delete: every entry but the control ones.
        names = (
            *(d.name for d in plan.delete),
            *(k.name for k in plan.keep if k.reason not in (KeepReason.CONTROL, KeepReason.BUSY)),
        )
        what = "entries a wipe would delete"
    else:
        names = plan.foreign
        what = "entries that are not version directories"
    if not names:
        return None
    return (
        f"{root} has no {MARKER_NAME} marker and holds {what} (e.g. {names[0]!r}); "
        f"if it really is a payload root, mark it with `payload-gc --root {root} --init`"
    )
