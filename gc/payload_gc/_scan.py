"""Listing a payload root's direct children, measured, for plans and status reports."""

from __future__ import annotations

import os
from pathlib import Path

from ._mounts import MountId, entry_mount_id, fd_mount_id
from ._plan import CollectionPlan, EntryKind, RootEntry, Usage, plan_collection
from ._tree import entry_kind, list_dir, measure_dir, open_root


def list_root(root_fd: int, *, measure: bool, root_mount: MountId | None = None) -> list[RootEntry]:
    """The direct children of the open root, without following links; with `measure`,
    version-named directories on the root's mount carry their usage (links
    `Usage(0, 0)`). An entry whose mount identity is not `root_mount` (the root's, taken
    from `root_fd` when not given) is a mount point: `same_filesystem=False`, never
    entered. Entries that vanish while listed are left out."""
    if root_mount is None:
        root_mount = fd_mount_id(root_fd)
    entries: list[RootEntry] = []
    for dirent in list_dir(root_fd):
        try:
            st = dirent.stat(follow_symlinks=False)
            on_root_mount = entry_mount_id(root_fd, dirent.name) == root_mount
        except FileNotFoundError:
            continue
        kind = entry_kind(st.st_mode)
        entry = RootEntry(dirent.name, kind, same_filesystem=on_root_mount)
        if measure and entry.version is not None:
            entry = _measured(root_fd, entry, root_mount)
        entries.append(entry)
    return entries


def _measured(root_fd: int, entry: RootEntry, root_mount: MountId) -> RootEntry:
    if entry.kind is EntryKind.SYMLINK:
        return RootEntry(entry.name, entry.kind, entry.same_filesystem, Usage(0, 0))
    if entry.kind is not EntryKind.DIRECTORY or not entry.same_filesystem:
        return entry
    try:
        usage = measure_dir(root_fd, entry.name, root_mount)
    except OSError:
        # Vanished or unreadable: shown as unmeasured rather than failing the listing.
        return entry
    return RootEntry(entry.name, entry.kind, entry.same_filesystem, usage)


def scan_root(root: str | os.PathLike[str], *, measure: bool = True) -> list[RootEntry]:
    """List the direct children of `root` without following links, with the files and
    bytes each version directory holds (so it also serves per-version disk use). With
    `measure=False` no directory is entered (every usage is `None`): cheap however many
    files the root holds. Mount points are flagged either way (`same_filesystem`).

    Raises `RootMissing` if `root` does not exist, `RootRefused` if it is a symbolic
    link or not a directory, `PayloadGCError` if it cannot be opened.
    """
    root_fd = open_root(os.fspath(root))
    try:
        return list_root(root_fd, measure=measure)
    finally:
        os.close(root_fd)


def plan_root(root: str | os.PathLike[str], bound: int, *, measure: bool = True) -> CollectionPlan:
    """Scan `root` and plan a collection at `bound`: what a real collection would delete
    right now (with files and bytes, unless `measure=False`) and why everything else
    stays. Deletes nothing.

    Raises what `scan_root` raises.
    """
    return plan_collection(scan_root(Path(root), measure=measure), bound)
