"""A collection looks only at what it deletes: the root's listing, then the directories
below the bound. No kept version is opened, listed, stat-ed or mount-checked, so on a
network filesystem that does not cache attributes a collection costs what it deletes,
not what the root holds (docs/design.md §8).

Every call payload_gc makes on a name goes through `os` (or, for the mount check, through
`entry_mount_id`: `statx` by ctypes, which no patch of `os` sees, so it is recorded where
payload_gc/_scan.py calls it), with the name relative to a directory descriptor: recording
those names shows which entries were touched. The dry run with `--measure-kept`, which walks
the kept versions on purpose, shows that the recording sees such walks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import payload_gc._scan as scan
import pytest
import trio
from payload_gc import collect_below, collect_below_sync, init_root, plan_root
from payload_gc.cli import main

BOUND = 4
KEPT = [f"v{k}" for k in range(BOUND, BOUND + 5)]


class Touched:
    """The names (and paths) payload_gc's calls were made on."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], str | os.PathLike):
                self.names.append(os.fspath(args[0]))
            elif len(args) > 1 and isinstance(args[1], str):
                self.names.append(args[1])  # entry_mount_id(dir_fd, name)
            return call(*args, **kwargs)

        return recorded

    def kept(self, root: Path) -> list[str]:
        """The recorded names that are, or lie below, a kept version directory."""
        prefixes = [f"{root}/{name}" for name in KEPT]
        return [
            name
            for name in self.names
            if name in KEPT or any(name == p or name.startswith(f"{p}/") for p in prefixes)
        ]


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Touched]:
    recorder = Touched()
    for name in ("open", "stat", "lstat", "scandir", "listdir", "rmdir", "unlink"):
        monkeypatch.setattr(os, name, recorder.wrap(getattr(os, name)))
    monkeypatch.setattr(scan, "entry_mount_id", recorder.wrap(scan.entry_mount_id))
    yield recorder


def _build(root: Path) -> None:
    for version in range(BOUND + len(KEPT)):
        directory = root / f"v{version}"
        (directory / "sub").mkdir(parents=True)
        for i in range(5):
            (directory / f"{i}.bin").write_bytes(b"x" * 100)
        (directory / "sub" / "s.bin").write_bytes(b"y" * 10)
    (root / "notes.txt").write_text("an entry that is no version")


def _check_deleted(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == sorted(KEPT)
    for name in KEPT:
        assert len(list((root / name).rglob("*"))) == 7


def test_the_collection_touches_no_kept_version(tmp_path: Path, touched: Touched) -> None:
    _build(tmp_path)
    report = collect_below_sync(tmp_path, BOUND)
    assert (report.dirs, report.files, report.bytes) == (BOUND, BOUND * 6, BOUND * 510)
    assert touched.kept(tmp_path) == []
    # The directories it deleted were looked at: the recording does see calls.
    assert "v0" in touched.names
    _check_deleted(tmp_path)


async def test_the_async_collection_touches_no_kept_version(
    tmp_path: Path, touched: Touched
) -> None:
    _build(tmp_path)
    report = await collect_below(tmp_path, BOUND)
    assert report.files == BOUND * 6
    assert touched.kept(tmp_path) == []
    await trio.to_thread.run_sync(_check_deleted, tmp_path)


def test_payload_gc_real_run_touches_no_kept_version(
    tmp_path: Path, touched: Touched, capsys: pytest.CaptureFixture[str]
) -> None:
    _build(tmp_path)
    init_root(tmp_path)
    assert main(["--root", str(tmp_path), "--below", str(BOUND)]) == 0
    assert capsys.readouterr().out.startswith(f"deleted {BOUND} directories, {BOUND * 6} files")
    assert touched.kept(tmp_path) == []
    _check_deleted(tmp_path)


def test_the_dry_run_measures_what_it_would_delete_and_kept_versions_on_request(
    tmp_path: Path, touched: Touched, capsys: pytest.CaptureFixture[str]
) -> None:
    _build(tmp_path)
    init_root(tmp_path)
    assert main(["--root", str(tmp_path), "--below", str(BOUND), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would delete {BOUND} directories, {BOUND * 6} files, {BOUND * 510} bytes" in out
    assert touched.kept(tmp_path) == []

    argv = ["--root", str(tmp_path), "--below", str(BOUND), "--dry-run", "--measure-kept"]
    assert main(argv) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[3:-2]}
    assert rows["v4"][1:3] == ["keep", "6"]
    # Measuring kept versions on purpose is seen by the same recording.
    assert set(KEPT) <= set(touched.kept(tmp_path))


def test_the_cheap_plan_is_the_full_plan(tmp_path: Path) -> None:
    _build(tmp_path)
    (tmp_path / "v1").rename(tmp_path / "v01")
    (tmp_path / "v2" / "sub" / "s.bin").unlink()
    (tmp_path / "v3x").mkdir()
    (tmp_path / "v2.bin").write_bytes(b"")
    (tmp_path / "v1").symlink_to(tmp_path / "v5")
    full = plan_root(tmp_path, BOUND)
    for measure in (True, False):
        cheap = plan_root(tmp_path, BOUND, measure=measure, measure_kept=False)
        assert [(d.name, d.kind) for d in cheap.delete] == [(d.name, d.kind) for d in full.delete]
        assert [(k.name, k.reason) for k in cheap.keep] == [(k.name, k.reason) for k in full.keep]
        assert cheap.marked == full.marked
        if measure:
            assert (cheap.files, cheap.bytes) == (full.files, full.bytes)
            assert all(k.usage is None for k in cheap.keep)


def test_measure_kept_goes_with_a_dry_run_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init_root(tmp_path)
    assert main(["--root", str(tmp_path), "--below", "1", "--measure-kept"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "payload-gc: error: --measure-kept goes with --dry-run (a real run measures nothing kept)\n"
    )
