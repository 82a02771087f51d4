"""Bind mounts inside a payload root are never entered, by the CLI, the API or a wipe (the
daemon refusing such a root: tests/integration/test_gc_mounts.py).

A bind mount of a directory of the same filesystem has the root's `st_dev`, so only the
mount id tells it apart. The root below holds `v9` with a file of its own and a
subdirectory `bindmnt` bind-mounted to an outside directory, and `v11` that is itself a
bind mount of another outside directory. The outside files (canaries) must survive every
collection and wipe, byte for byte.

These tests need root (`mount --bind`); they skip with the reason otherwise, and always
unmount in teardown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
from payload_gc import KeepReason, collect_below_sync, init_root, wipe_root

if TYPE_CHECKING:
    from suite_plugin import BindMount


_OWN = b"v9's own file"


@attrs.frozen
class _Layout:
    root: Path
    outside: Path


def _snapshot(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def layout(tmp_path: Path, bind_mount: BindMount) -> Iterator[_Layout]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "bindsrc" / "deeper").mkdir(parents=True)
    (outside / "bindsrc" / "canary.txt").write_text("bind canary\n")
    (outside / "bindsrc" / "deeper" / "canary.bin").write_bytes(b"\x00\x01deep")
    (outside / "v11src").mkdir()
    (outside / "v11src" / "canary.txt").write_text("v11 canary\n")
    (root / "v9" / "bindmnt").mkdir(parents=True)
    (root / "v9" / "own.bin").write_bytes(_OWN)
    (root / "v11").mkdir()
    (root / "v3" / "sub").mkdir(parents=True)
    (root / "v3" / "a.bin").write_bytes(b"123")
    (root / "v3" / "sub" / "b.bin").write_bytes(b"45")
    (root / "v25").mkdir()
    (root / "v25" / "fresh.bin").write_bytes(b"fresh")
    init_root(root)
    with ExitStack() as mounts:
        mounts.enter_context(bind_mount(outside / "bindsrc", root / "v9" / "bindmnt"))
        mounts.enter_context(bind_mount(outside / "v11src", root / "v11"))
        # The case st_dev cannot tell apart: the same filesystem as the root.
        assert (root / "v11").stat().st_dev == root.stat().st_dev
        assert (root / "v11" / "canary.txt").read_text() == "v11 canary\n"
        before = _snapshot(outside)
        yield _Layout(root, outside)
        assert _snapshot(outside) == before, "files outside the root changed"


def _payload_gc(*argv: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("payload-gc")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "payload_gc"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=60)


def _assert_collected_around_the_mounts(layout: _Layout) -> None:
    root = layout.root
    assert not (root / "v3").exists()
    assert not (root / "v9" / "own.bin").exists()
    # v9 stays only because of its mount point, which still shows the outside files.
    assert sorted(p.name for p in (root / "v9").iterdir()) == ["bindmnt"]
    assert (root / "v9" / "bindmnt" / "canary.txt").read_text() == "bind canary\n"
    assert (root / "v11" / "canary.txt").read_text() == "v11 canary\n"
    assert (root / "v25" / "fresh.bin").read_bytes() == b"fresh"


def test_dry_run_keeps_the_mount_point_and_does_not_measure_through_mounts(
    layout: _Layout,
) -> None:
    args = ("--root", str(layout.root), "--below", "20", "--dry-run")
    text = _payload_gc(*args)
    assert (text.returncode, text.stderr) == (0, "")
    assert text.stdout.startswith("DRY RUN: nothing was deleted\n")
    [v11_row] = [line.split() for line in text.stdout.splitlines() if line.startswith("  v11 ")]
    assert v11_row[:2] == ["v11", "keep"]
    assert " ".join(v11_row[4:]) == "mount point (not entered)"

    document = json.loads(_payload_gc(*args, "--json").stdout)
    kept = {k["name"]: k for k in document["keep"]}
    assert kept["v11"] == {
        "name": "v11",
        "version": 11,
        "files": None,
        "bytes": None,
        "reason": "mount point (not entered)",
    }
    deletions = {d["name"]: (d["files"], d["bytes"]) for d in document["delete"]}
    # v9 counts its own file only, not the canaries behind its mount point.
    assert deletions == {"v3": (2, 5), "v9": (1, len(_OWN))}
    assert (layout.root / "v9" / "own.bin").exists()
    assert (layout.root / "v3" / "a.bin").exists()


def test_cli_real_run_is_partial_names_the_mount_points_and_exits_1(layout: _Layout) -> None:
    done = _payload_gc("--root", str(layout.root), "--below", "20")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        f"deleted 1 directories, 3 files, {5 + len(_OWN)} bytes from {layout.root}"
    )
    assert "PARTIAL: 2 entries could not be deleted entirely:" in lines
    assert "  v9: v9/bindmnt: mount point (not entered), left in place" in lines
    assert "  v11: mount point (not entered), left in place" in lines
    assert lines[-1].endswith("(partial)")
    _assert_collected_around_the_mounts(layout)
    audit = (layout.root / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    record = json.loads(audit[-1])
    assert record["outcome"] == "partial"
    assert record["errors"] == [
        "v9: v9/bindmnt: mount point (not entered), left in place",
        "v11: mount point (not entered), left in place",
    ]


def test_python_api_collects_around_the_mount_points(layout: _Layout) -> None:
    report = collect_below_sync(layout.root, 20)
    assert report.outcome == "partial"
    assert [d.name for d in report.deleted] == ["v3"]
    assert [(e.name, e.message) for e in report.errors] == [
        ("v9", "v9/bindmnt: mount point (not entered), left in place"),
        ("v11", "mount point (not entered), left in place"),
    ]
    kept = {k.name: k.reason for k in report.kept}
    assert kept["v11"] is KeepReason.MOUNT_POINT
    assert kept["v25"] is KeepReason.AT_OR_ABOVE_BOUND
    # What went: v3's two files and v9's own; nothing from behind a mount point.
    assert (report.files, report.bytes) == (3, 5 + len(_OWN))
    _assert_collected_around_the_mounts(layout)


def test_wipe_leaves_mount_points_in_place(layout: _Layout) -> None:
    report = wipe_root(layout.root)
    assert report.kept == ("v11",)
    assert [(e.name, e.message) for e in report.errors] == [
        ("v9", "v9/bindmnt: mount point (not entered), left in place")
    ]
    assert report.outcome == "partial"
    root = layout.root
    assert sorted(p.name for p in root.iterdir()) == [".payload-gc", ".payload-root", "v11", "v9"]
    assert sorted(p.name for p in (root / "v9").iterdir()) == ["bindmnt"]
    assert (root / "v9" / "bindmnt" / "deeper" / "canary.bin").read_bytes() == b"\x00\x01deep"
    assert (root / "v11" / "canary.txt").read_text() == "v11 canary\n"
