"""Busy files: files deleted while still open, which an NFS client (`.nfs<hex>`) or a FUSE
filesystem (`.fuse_hidden<hex>`) keeps under a hidden name until they are closed.

A collection, a wipe and the daemon's file removal leave them alone and say "busy", not
"partial": the directory holding them stays below the bound, and the next collection
removes it once the files are closed. Nothing of the collector's own is left behind in
`.payload-gc/`, and busy files there are tolerated.

Two ways to get busy files without a network mount: files created under such names (what
a root holds after a client renamed them), and `silly_renames`, which makes unlinking a
file this process really holds open do what those clients do (NFS: rename it to
`.nfs<hex>`, refuse to unlink that name with EBUSY while the file is open; FUSE: rename
it to `.fuse_hidden<hex>`, and again on every later unlink while open) and removes the
hidden names when the test closes the files.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import attrs
import pytest
import trio
from payload_gc import (
    collect_below,
    collect_below_sync,
    init_root,
    is_busy_name,
    remove_files,
    wipe_root,
)
from payload_gc._lock import current_owner
from payload_gc.cli import main
from payload_trees import make_version

from orchestrator.daemon.payload_files.disk import unlink_files
from orchestrator.daemon.startup import wipe_payload_root

NFS = ".nfs000000000123abcd00000001"
FUSE = ".fuse_hidden0000000a00000001"
REAL_UNLINK = os.unlink


def _open_inodes() -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file this process has open."""
    found: set[tuple[int, int]] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        found.add((st.st_dev, st.st_ino))
    return found


@attrs.define
class SillyRenames:
    """Unlinking a file that this process holds open does what an NFS or FUSE client
    does (see the module docstring). `open` opens a file and keeps it open; `close_all`
    closes them and removes their hidden names, as the client does on close."""

    style: Literal["nfs", "fuse"]
    fds: list[int] = attrs.field(factory=list)
    hidden: list[tuple[int | None, str]] = attrs.field(factory=list)
    renames: int = 0

    def open(self, path: Path) -> None:
        self.fds.append(os.open(path, os.O_RDONLY))

    def unlink(self, path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) not in _open_inodes():
            REAL_UNLINK(path, dir_fd=dir_fd)
            return
        name = os.fspath(path)
        if self.style == "nfs" and is_busy_name(os.path.basename(name)):
            # The Linux NFS client refuses to delete a silly-renamed file still open.
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), name)
        self.renames += 1
        prefix = ".nfs" if self.style == "nfs" else ".fuse_hidden"
        hidden = os.path.join(os.path.dirname(name), f"{prefix}{st.st_ino:016x}{self.renames:08x}")
        os.rename(path, hidden, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self.hidden = [h for h in self.hidden if h != (dir_fd, name)]
        self.hidden.append((dir_fd, hidden))

    def close_all(self, root: Path) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        # The descriptors the names were relative to are closed by now: find them again.
        for path in root.rglob("*"):
            if is_busy_name(path.name) and path.is_file():
                REAL_UNLINK(path)


@pytest.fixture(params=["nfs", "fuse"])
def silly_renames(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SillyRenames]:
    emulation = SillyRenames(request.param)
    monkeypatch.setattr(os, "unlink", emulation.unlink)
    try:
        yield emulation
    finally:
        for fd in emulation.fds:
            os.close(fd)


def _make_version(root: Path, version: int, files: int = 3, size: int = 10) -> None:
    make_version(root, version, files, size)


def _audit(root: Path) -> list[dict[str, object]]:
    lines = (root / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_busy_files_leave_their_directory_busy_and_the_next_collection_removes_it(
    tmp_path: Path,
) -> None:
    _make_version(tmp_path, 1, files=2)
    (tmp_path / "v1" / "sub").mkdir()
    (tmp_path / "v1" / "sub" / "c.bin").write_bytes(b"c" * 10)
    (tmp_path / "v1" / NFS).write_bytes(b"n" * 100)
    (tmp_path / "v1" / "sub" / FUSE).write_bytes(b"f" * 100)
    _make_version(tmp_path, 2)
    _make_version(tmp_path, 5)

    report = collect_below_sync(tmp_path, 3)
    assert report.errors == ()
    assert report.outcome == "busy"
    assert [d.name for d in report.deleted] == ["v2"]
    (busy,) = report.busy
    assert (busy.name, busy.version, busy.busy) == ("v1", 1, 2)
    assert sorted(busy.paths) == [f"v1/{NFS}", f"v1/sub/{FUSE}"]
    # What was deleted from v1 counts; the busy files do not.
    assert (busy.files, busy.bytes) == (3, 30)
    assert (report.dirs, report.files, report.bytes) == (1, 6, 60)
    assert _names(tmp_path / "v1") == [NFS, "sub"]
    assert _names(tmp_path / "v1" / "sub") == [FUSE]
    assert "v1" not in {k.name for k in report.kept}
    (line,) = _audit(tmp_path)
    assert line["outcome"] == "busy"
    assert line["files"] == 6
    assert line["deleted"] == ["v2"]
    assert "errors" not in line
    (entry,) = line["busy"]  # type: ignore[misc]
    assert str(entry).startswith("v1: 2 busy files (")
    assert "the next collection tries again" in str(entry)

    # Closed: their clients remove the hidden names. The next collection finishes v1.
    (tmp_path / "v1" / NFS).unlink()
    (tmp_path / "v1" / "sub" / FUSE).unlink()
    report = collect_below_sync(tmp_path, 3)
    assert (report.outcome, report.busy, report.errors) == ("complete", (), ())
    assert [(d.name, d.files) for d in report.deleted] == [("v1", 0)]
    assert _names(tmp_path) == [".payload-gc", "v5"]


def test_a_file_open_elsewhere_is_silly_renamed_during_the_collection(
    tmp_path: Path, silly_renames: SillyRenames
) -> None:
    _make_version(tmp_path, 1, files=4)
    _make_version(tmp_path, 2)
    silly_renames.open(tmp_path / "v1" / "2.bin")

    report = collect_below_sync(tmp_path, 3)
    # Before busy files were known: FUSE's hidden name was unlinked (and hidden again)
    # and counted each time, NFS's refused with EBUSY: "partial", exit status 1.
    assert report.errors == ()
    assert report.outcome == "busy"
    assert [d.name for d in report.deleted] == ["v2"]
    (busy,) = report.busy
    assert busy.name == "v1"
    assert busy.busy == 1
    # Every file of v1 was deleted once (the open one's name included), none twice.
    assert (busy.files, busy.bytes) == (4, 40)
    assert report.files == 7
    assert silly_renames.renames == 1
    (hidden,) = _names(tmp_path / "v1")
    assert is_busy_name(hidden)
    assert busy.paths == (f"v1/{hidden}",)

    silly_renames.close_all(tmp_path)
    report = collect_below_sync(tmp_path, 3)
    assert (report.outcome, [d.name for d in report.deleted]) == ("complete", ["v1"])
    assert _names(tmp_path) == [".payload-gc"]


async def test_the_async_collection_reports_busy_directories(
    tmp_path: Path, silly_renames: SillyRenames
) -> None:
    _make_version(tmp_path, 0)
    (tmp_path / "v0" / "deep").mkdir()
    (tmp_path / "v0" / "deep" / "d.bin").write_bytes(b"d")
    silly_renames.open(tmp_path / "v0" / "deep" / "d.bin")
    report = await collect_below(tmp_path, 1)
    assert report.outcome == "busy"
    assert [b.name for b in report.busy] == ["v0"]
    assert report.files == 4
    assert _audit(tmp_path)[-1]["outcome"] == "busy"


def test_cli_exit_status_is_0_for_busy_files_and_1_for_a_real_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    _make_version(root, 1)
    (root / "v1" / NFS).write_bytes(b"n")
    _make_version(root, 2)
    init_root(root)

    assert main(["--root", str(root), "--below", "3", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    v1 = next(d for d in dry["delete"] if d["name"] == "v1")
    assert (v1["files"], v1["busy_files"]) == (3, 1)
    assert "busy file" in v1["note"]
    assert main(["--root", str(root), "--below", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "BUSY: v1 hold busy files" in out

    assert main(["--root", str(root), "--below", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"deleted 1 directories, 6 files, 60 bytes from {root} (bound v3)"
    assert "BUSY: 1 directories left only for busy files:" in out
    assert out.splitlines()[-1].endswith("(busy)")
    assert any(line.split()[:2] == ["v1", "busy"] for line in out.splitlines())

    # With something else left below the bound too, the run is partial: exit status 1.
    _make_version(root, 0)
    (root / "v0" / "locked").mkdir()
    import payload_gc._tree as tree

    real_list_dir = tree.list_dir
    locked_ino = (root / "v0" / "locked").stat().st_ino

    def list_dir(fd: int) -> list[os.DirEntry[str]]:
        # Root bypasses permissions, so a listing refused by EACCES is injected.
        if os.fstat(fd).st_ino == locked_ino:
            raise PermissionError(13, "Permission denied")
        return real_list_dir(fd)

    monkeypatch.setattr(tree, "list_dir", list_dir)
    assert main(["--root", str(root), "--below", "3", "--json"]) == 1
    real = json.loads(capsys.readouterr().out)
    assert real["outcome"] == "partial"
    assert [e["name"] for e in real["errors"]] == ["v0"]
    assert [b["name"] for b in real["busy"]] == ["v1"]
    assert real["busy"][0]["busy_files"] == 1


def test_the_wipe_leaves_busy_files_and_a_fresh_run_starts_anyway(tmp_path: Path) -> None:
    root = tmp_path / "payloads"
    init_root(root)
    _make_version(root, 0)
    (root / "v0" / FUSE).write_bytes(b"f")
    _make_version(root, 1)
    (root / NFS).write_bytes(b"n")
    (root / "stray").write_bytes(b"s")

    report = wipe_root(root)
    assert report.errors == ()
    assert report.outcome == "busy"
    assert sorted(report.busy)[0].startswith(f"{NFS}: busy")
    assert sorted(report.busy)[1].startswith("v0: 1 busy file (v0/")
    assert (report.entries, report.files) == (2, 7)  # v1 and the stray file; 3 + 3 + 1
    assert _names(root) == [NFS, ".payload-gc", ".payload-root", "v0"]
    assert _names(root / "v0") == [FUSE]
    line = _audit(root)[-1]
    assert (line["action"], line["outcome"]) == ("wipe", "busy")
    assert len(line["busy"]) == 2  # type: ignore[arg-type]

    # The fresh-run start-up goes on: nothing of the new run can meet those names.
    trio.run(wipe_payload_root, root)


def test_remove_files_leaves_busy_names_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _make_version(root, 1, files=2)
    (root / "v1" / NFS).write_bytes(b"n" * 5)
    removal = remove_files(root, [(1, "0.bin"), (1, NFS), (1, "1.bin")])
    assert (removal.files, removal.bytes, removal.problem_count) == (2, 20, 0)
    assert removal.busy == 1
    assert removal.left == ((1, NFS),)
    assert _names(root / "v1") == [NFS]
    # The daemon's path-based removal on top of it.
    removal = unlink_files(root, [f"{root}/v1/{NFS}"])
    assert (removal.files, removal.busy, removal.problem_count) == (0, 1, 0)


def test_busy_files_in_the_control_directory_are_tolerated(tmp_path: Path) -> None:
    control = tmp_path / ".payload-gc"
    control.mkdir()
    (control / NFS).write_bytes(b"a lock some reader still had open")
    (control / FUSE).write_bytes(b"another")
    _make_version(tmp_path, 0)
    report = collect_below_sync(tmp_path, 1)
    assert (report.outcome, report.errors, report.busy) == ("complete", (), ())
    init_root(tmp_path)
    wiped = wipe_root(tmp_path)
    assert (wiped.outcome, wiped.errors, wiped.busy) == ("complete", (), ())
    # Not ours: left for their filesystem to remove once closed.
    assert _names(control) == [FUSE, NFS, "audit.jsonl"]


def _write_stale_lock(root: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    owner = current_owner()
    data = {
        "host": owner.host,
        "pid": child.pid,
        "time": time.time() - 100,
        "token": "feedfeedfeedfeed",
        "boot_id": owner.boot_id,
        "start_ticks": None,
    }
    (root / ".payload-gc").mkdir(exist_ok=True)
    (root / ".payload-gc" / "lock").write_text(json.dumps(data))


def test_a_stale_lock_moved_aside_by_a_collector_that_died_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import payload_gc._lock as lock

    control = tmp_path / ".payload-gc"
    control.mkdir()
    (control / "lock.stale-0123456789abcdef").write_text("{}")
    (control / NFS).write_bytes(b"busy")
    # Younger than the grace: perhaps a collector still breaking a stale lock. Kept.
    collect_below_sync(tmp_path, 1)
    assert _names(control) == [NFS, "audit.jsonl", "lock.stale-0123456789abcdef"]
    # Older (the grace shortened instead of waiting a minute): removed by the next holder.
    monkeypatch.setattr(lock, "ASIDE_GRACE_S", -1.0)
    collect_below_sync(tmp_path, 1)
    assert _names(control) == [NFS, "audit.jsonl"]


def test_the_collector_closes_its_own_files_before_unlinking_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unlinked: list[str] = []

    def unlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        # On NFS or FUSE a file unlinked while open stays behind as a busy file.
        assert (st.st_dev, st.st_ino) not in _open_inodes(), f"{path} is still open"
        unlinked.append(os.fspath(path))
        REAL_UNLINK(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    _make_version(tmp_path, 0)
    _write_stale_lock(tmp_path)  # taken over: moved aside, read, removed
    report = collect_below_sync(tmp_path, 1)
    assert report.outcome == "complete"
    init_root(tmp_path)
    _make_version(tmp_path, 1)
    assert wipe_root(tmp_path).outcome == "complete"
    ours = [name for name in unlinked if name == "lock" or name.startswith("lock.stale-")]
    assert ours.count("lock") == 2  # released by the collection and by the wipe
    assert len(ours) == 3
    assert _names(tmp_path / ".payload-gc") == ["audit.jsonl"]
