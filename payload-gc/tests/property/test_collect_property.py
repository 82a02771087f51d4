"""Property tests: on random trees and bounds, a collection deletes exactly the version
directories (and version-named links) below the bound, and not one other byte; busy files
keep exactly their directories; the collection's cheap listing plans what a full scan
plans."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from payload_gc import (
    EntryKind,
    RootEntry,
    collect_below_sync,
    is_busy_name,
    parse_version,
    plan_collection,
    plan_root,
)

NAMES = st.one_of(
    st.integers(0, 12).map(lambda k: f"v{k}"),
    st.sampled_from(["vx", "v007", "V3", "v3a", "v-1", "notes", "v", "data.bin", ".hidden"]),
)
FILE_NAMES = st.sampled_from(["a.bin", "b.bin", "v3", "c", "vx"])
CONTENT = st.binary(max_size=64)

# A directory's contents: files and (recursively) subdirectories.
TREE = st.recursive(
    st.dictionaries(FILE_NAMES, CONTENT, max_size=3),
    lambda children: st.dictionaries(st.sampled_from(["d1", "d2", "v1"]), children, max_size=2),
    max_leaves=6,
)
TOP_KIND = st.sampled_from(["dir", "file", "link_out", "link_in"])
TOP = st.dictionaries(NAMES, st.tuples(TOP_KIND, TREE, CONTENT), max_size=8)


def _build(directory: Path, tree: dict[str, object]) -> None:
    directory.mkdir(exist_ok=True)
    for name, value in tree.items():
        if isinstance(value, bytes):
            (directory / name).write_bytes(value)
        else:
            assert isinstance(value, dict)
            _build(directory / name, value)


def _snapshot(top: Path) -> dict[str, tuple[str, bytes]]:
    """Every path below `top` (not following links) with its kind and content."""
    found: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(top))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path).encode())
            elif path.is_dir():
                found[rel] = ("dir", b"")
            else:
                found[rel] = ("file", path.read_bytes())
    return found


@settings(max_examples=60, deadline=None)
@given(top=TOP, bound=st.integers(-3, 14), outside_tree=TREE)
def test_collection_deletes_exactly_the_versions_below_the_bound(
    top: dict[str, tuple[str, dict[str, object], bytes]],
    bound: int,
    outside_tree: dict[str, object],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root, outside = base / "root", base / "outside"
        _build(outside, outside_tree)
        (outside / "sentinel").write_bytes(b"must survive")
        root.mkdir()
        for name, (kind, tree, content) in top.items():
            if kind == "dir":
                _build(root / name, tree)
                # A link inside each directory pointing out of the root.
                (root / name / "escape").symlink_to(outside, target_is_directory=True)
            elif kind == "file":
                (root / name).write_bytes(content)
            elif kind == "link_out":
                (root / name).symlink_to(outside, target_is_directory=True)
            else:
                (root / name).symlink_to("notes")  # relative, possibly dangling
        before_root, before_outside = _snapshot(root), _snapshot(outside)

        def goes(name: str) -> bool:
            version = parse_version(name)
            kind = top[name][0]
            return version is not None and version < bound and kind != "file"

        doomed = {name for name in top if goes(name)}
        report = collect_below_sync(root, bound, max_workers=3)

        assert {d.name for d in report.deleted} == doomed
        assert report.errors == ()
        expected = {
            rel: value for rel, value in before_root.items() if rel.split("/")[0] not in doomed
        }
        after = {
            rel: value
            for rel, value in _snapshot(root).items()
            if rel.split("/")[0] != ".payload-gc"
        }
        assert after == expected
        assert _snapshot(outside) == before_outside


ENTRIES = st.lists(
    st.builds(
        RootEntry,
        name=NAMES,
        kind=st.sampled_from(list(EntryKind)),
        same_filesystem=st.booleans(),
    ),
    unique_by=lambda e: e.name,
    max_size=12,
)


@settings(max_examples=200)
@given(entries=ENTRIES, bound=st.integers(-3, 14), raise_by=st.integers(0, 5))
def test_plan_partitions_and_grows_with_the_bound(
    entries: list[RootEntry], bound: int, raise_by: int
) -> None:
    plan = plan_collection(entries, bound)
    deleted = {d.name for d in plan.delete}
    kept = {k.name for k in plan.keep}
    assert deleted | kept == {e.name for e in entries}
    assert not deleted & kept
    assert all(d.version < bound for d in plan.delete)
    if bound <= 0:
        assert not deleted
    higher = plan_collection(entries, bound + raise_by)
    assert deleted <= {d.name for d in higher.delete}


NFS = ".nfs000000000123abcd00000001"
FUSE = ".fuse_hidden0000000a00000001"
# Trees that may hold busy files (deleted while open, silly-renamed) anywhere below them.
BUSY_TREE = st.recursive(
    st.dictionaries(st.sampled_from(["a.bin", "b.bin", NFS, FUSE]), CONTENT, max_size=3),
    lambda children: st.dictionaries(st.sampled_from(["d1", "d2"]), children, max_size=2),
    max_leaves=6,
)


def _files_and_busy(tree: dict[str, object]) -> tuple[int, int, int]:
    """(files, bytes, busy files) a tree holds."""
    files = size = busy = 0
    for name, value in tree.items():
        if isinstance(value, bytes):
            if is_busy_name(name):
                busy += 1
            else:
                files, size = files + 1, size + len(value)
        else:
            assert isinstance(value, dict)
            sub = _files_and_busy(value)
            files, size, busy = files + sub[0], size + sub[1], busy + sub[2]
    return files, size, busy


@settings(max_examples=60, deadline=None)
@given(
    versions=st.dictionaries(st.integers(0, 8), BUSY_TREE, max_size=6),
    bound=st.integers(-1, 10),
)
def test_busy_files_keep_exactly_their_directories_and_count_for_nothing(
    versions: dict[int, dict[str, object]], bound: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for version, tree in versions.items():
            _build(root / f"v{version}", tree)
        doomed = {v: _files_and_busy(tree) for v, tree in versions.items() if v < bound}
        report = collect_below_sync(root, bound, max_workers=2)

        busy = {v for v, (_, _, b) in doomed.items() if b}
        assert report.errors == ()
        assert {b.version for b in report.busy} == busy
        assert {d.version for d in report.deleted} == set(doomed) - busy
        assert report.outcome == ("busy" if busy else "complete")
        # Every other file below the bound was deleted and counted once; no busy one.
        assert report.files == sum(f for f, _, _ in doomed.values())
        assert report.bytes == sum(b for _, b, _ in doomed.values())
        assert {b.version: b.busy for b in report.busy} == {v: doomed[v][2] for v in busy}
        for version in busy:
            left = [p for p in (root / f"v{version}").rglob("*") if not p.is_dir()]
            assert left and all(is_busy_name(p.name) for p in left)
            assert len(left) == doomed[version][2]
        for version, tree in versions.items():
            if version >= bound:
                assert _snapshot(root / f"v{version}") == _snapshot_tree(tree)


def _snapshot_tree(tree: dict[str, object], prefix: str = "") -> dict[str, tuple[str, bytes]]:
    found: dict[str, tuple[str, bytes]] = {}
    for name, value in tree.items():
        rel = f"{prefix}{name}"
        if isinstance(value, bytes):
            found[rel] = ("file", value)
        else:
            assert isinstance(value, dict)
            found[rel] = ("dir", b"")
            found.update(_snapshot_tree(value, f"{rel}/"))
    return found


@settings(max_examples=60, deadline=None)
@given(top=TOP, bound=st.integers(-3, 14), measure=st.booleans())
def test_the_listing_for_a_bound_plans_what_the_full_scan_plans(
    top: dict[str, tuple[str, dict[str, object], bytes]], bound: int, measure: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (kind, tree, content) in top.items():
            if kind == "dir":
                _build(root / name, tree)
            elif kind == "file":
                (root / name).write_bytes(content)
            elif kind == "link_out":
                (root / name).symlink_to(tmp, target_is_directory=True)
            else:
                (root / name).symlink_to("notes")
        full = plan_root(root, bound)
        cheap = plan_root(root, bound, measure=measure, measure_kept=False)
        assert cheap.delete == (full.delete if measure else cheap.delete)
        assert [(d.name, d.kind) for d in cheap.delete] == [(d.name, d.kind) for d in full.delete]
        assert [(k.name, k.reason) for k in cheap.keep] == [(k.name, k.reason) for k in full.keep]
        assert cheap.marked == full.marked
