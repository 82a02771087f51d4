"""Fresh-run wipe and root marking (docs/design.md §7): refusals, success, audit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from payload_gc import (
    LockHeld,
    RootRefused,
    collect_below_sync,
    init_root,
    wipe_root,
    wipe_root_async,
)
from payload_trees import lock_by_another_host


def _populate(root: Path) -> None:
    for version in range(3):
        (root / f"v{version}" / "sub").mkdir(parents=True)
        (root / f"v{version}" / "a.bin").write_bytes(b"12345678")
        (root / f"v{version}" / "sub" / "b.bin").write_bytes(b"12")
    (root / "stray-file").write_bytes(b"abc")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_wipe_creates_a_missing_root_and_marks_it(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "payloads"
    report = wipe_root(root)
    assert report.created
    assert (report.entries, report.files, report.bytes) == (0, 0, 0)
    assert report.outcome == "complete"
    assert _names(root) == [".payload-gc", ".payload-root"]
    assert "payload root" in (root / ".payload-root").read_text()


def test_wipe_empties_a_marked_root_and_keeps_marker_and_audit(tmp_path: Path) -> None:
    init_root(tmp_path)
    _populate(tmp_path)
    collect_below_sync(tmp_path, 1)  # an audit line from the previous run
    report = wipe_root(tmp_path)
    assert not report.created
    assert (report.entries, report.files, report.bytes) == (3, 5, 23)
    assert report.errors == ()
    assert _names(tmp_path) == [".payload-gc", ".payload-root"]
    lines = (tmp_path / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["action"] for r in records] == ["collect", "wipe"]
    wipe = records[1]
    assert (wipe["entries"], wipe["files"], wipe["bytes"]) == (3, 5, 23)
    assert wipe["outcome"] == "complete"
    assert wipe["root"] == str(tmp_path)
    assert not (tmp_path / ".payload-gc" / "lock").exists()


def test_wipe_of_an_empty_unmarked_directory_is_fine(tmp_path: Path) -> None:
    wipe_root(tmp_path)
    assert (tmp_path / ".payload-root").is_file()


def test_wipe_refuses_a_non_empty_unmarked_directory(tmp_path: Path) -> None:
    _populate(tmp_path)
    before = _names(tmp_path)
    with pytest.raises(RootRefused, match=r"no \.payload-root marker.*--init") as caught:
        wipe_root(tmp_path)
    assert "\n" not in str(caught.value)
    assert _names(tmp_path) == before  # not even the control directory was created


def test_wipe_refuses_unmarked_version_directories_too(tmp_path: Path) -> None:
    (tmp_path / "v0").mkdir()
    with pytest.raises(RootRefused, match=r"no \.payload-root marker and holds entries a wipe"):
        wipe_root(tmp_path)
    assert _names(tmp_path) == ["v0"]


def test_wipe_refuses_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / ".payload-root").write_text("")
    (real / "v0").mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(RootRefused, match="symbolic link"):
        wipe_root(tmp_path / "link")
    assert (real / "v0").is_dir()


@pytest.mark.parametrize("path", ["/", "/root", "/home", "/home/alice", "/tmp/../home/bob"])
def test_dangerous_roots(path: str) -> None:
    with pytest.raises(RootRefused, match="refusing to wipe payload root"):
        wipe_root(path)
    with pytest.raises(RootRefused, match="refusing to mark payload root"):
        init_root(path)


def test_home_directory_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "somebody"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(RootRefused, match="home directory"):
        wipe_root(home)
    # Below it is not the home directory itself.
    init_root(home / "run" / "payloads")
    assert wipe_root(home / "run" / "payloads").outcome == "complete"


def test_wipe_refuses_while_a_collector_holds_the_lock(tmp_path: Path) -> None:
    init_root(tmp_path)
    (tmp_path / "v0").mkdir()
    lock_by_another_host(tmp_path)
    with pytest.raises(LockHeld):
        wipe_root(tmp_path)
    assert (tmp_path / "v0").is_dir()


def test_marker_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".payload-root").mkdir()
    with pytest.raises(RootRefused, match="not a regular file"):
        init_root(tmp_path)


def test_init_keeps_an_existing_marker(tmp_path: Path) -> None:
    (tmp_path / ".payload-root").write_text("mine")
    init_root(tmp_path)
    assert (tmp_path / ".payload-root").read_text() == "mine"


async def test_async_wipe(tmp_path: Path) -> None:
    await trio.to_thread.run_sync(init_root, tmp_path)
    await trio.to_thread.run_sync(_populate, tmp_path)
    report = await wipe_root_async(tmp_path, max_workers=2)
    assert report.entries == 4
    assert await trio.to_thread.run_sync(_names, tmp_path) == [".payload-gc", ".payload-root"]
