"""Listing a payload root's direct children: in full (every entry stat-ed, mount points
flagged, optionally measured) for status reports, or only as far as a collection at a
bound needs (`list_for_bound`)."""

from __future__ import annotations

import os
from pathlib import Path

from ._mounts import MountId, entry_mount_id, fd_mount_id
from ._plan import CollectionPlan, EntryKind, RootEntry, Usage, plan_collection
from ._tree import dirent_kind, entry_kind, list_dir, measure_dir, open_root
from ._vanished import is_vanished


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
        except OSError as exc:
            if is_vanished(exc):
                continue
            raise
        kind = entry_kind(st.st_mode)
        entry = RootEntry(dirent.name, kind, same_filesystem=on_root_mount)
        if measure and entry.version is not None:
            entry = _measured(root_fd, entry, root_mount)
        entries.append(entry)
    return entries


def list_for_bound(
    root_fd: int, bound: int, *, root_mount: MountId, measure: bool = False
) -> list[RootEntry]:
    """The direct children of the open root, looked at only as far as a collection at
    `bound` needs: each entry's name and kind come from the listing itself (`d_type`; an
    `lstat` only where the filesystem gives no type), and only the entries a collection
    deletes, `v<k>` directories with `k < bound`, get one more call: their mount check
    (`same_filesystem`), and with `measure` their usage. Every other entry is neither
    stat-ed nor entered, so the cost does not grow with the versions kept: on a network
    filesystem that does not cache attributes, the difference between one call per
    version to delete and one per file kept.

    Entries that vanish while listed are left out. The plan made from this listing is
    the one a full listing gives (a mount point at or above the bound stays either way,
    so it is not looked for).
    """
    entries: list[RootEntry] = []
    for dirent in list_dir(root_fd):
        entry = RootEntry(dirent.name, dirent_kind(dirent))
        version = entry.version
        if version is None or version >= bound:
            entries.append(entry)
            continue
        if entry.kind is EntryKind.DIRECTORY:
            try:
                on_root_mount = entry_mount_id(root_fd, entry.name) == root_mount
            except OSError as exc:
                if is_vanished(exc):
                    continue
                raise
            entry = RootEntry(entry.name, entry.kind, same_filesystem=on_root_mount)
        if measure:
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


def plan_root(
    root: str | os.PathLike[str],
    bound: int,
    *,
    measure: bool = True,
    measure_kept: bool = True,
) -> CollectionPlan:
    """Plan a collection of `root` at `bound`: what a real collection would delete right
    now and why everything else stays. Deletes nothing.

    With `measure`, the directories to delete carry their files and bytes, and with
    `measure_kept` too the kept version directories: a walk of every file in the root,
    as `scan_root` does. Without `measure_kept` (or without `measure`) only the root's
    listing and the directories to delete are looked at (`list_for_bound`): the plan is
    the same, at the cost of the collection itself rather than of the whole root.

    Raises what `scan_root` raises.
    """
    path = Path(root)
    if measure and measure_kept:
        return plan_collection(scan_root(path, measure=True), bound)
    root_fd = open_root(os.fspath(path))
    try:
        root_mount = fd_mount_id(root_fd)
        entries = list_for_bound(root_fd, bound, root_mount=root_mount, measure=measure)
    finally:
        os.close(root_fd)
    return plan_collection(entries, bound)
