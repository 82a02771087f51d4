"""Collectors racing on one root: threads, processes and trio tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio
from payload_gc import LockHeld, collect_below, collect_below_sync
from payload_gc._mounts import fd_mount_id
from payload_gc._tree import Tally, open_root, remove_tree
from payload_trees import make_tree


def _make_tree(root: Path, versions: int, files: int) -> None:
    make_tree(root, versions, files, size=64)


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("v"))


def test_a_second_thread_reports_the_lock_while_the_first_collects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_tree(tmp_path, 3, 2)
    started, proceed = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # The first collector waits, holding the lock, at the payload files it deletes.
        if path.endswith(".bin"):
            started.set()
            assert proceed.wait(10)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    reports = []
    first = threading.Thread(target=lambda: reports.append(collect_below_sync(tmp_path, 3)))
    first.start()
    try:
        assert started.wait(10)
        with pytest.raises(LockHeld, match=f"locked by pid {os.getpid()}"):
            collect_below_sync(tmp_path, 3)
    finally:
        proceed.set()
        first.join()
    assert [d.name for d in reports[0].deleted] == ["v0", "v1", "v2"]
    assert _versions(tmp_path) == []


def test_unlocked_removers_racing_on_the_same_tree_see_no_errors(tmp_path: Path) -> None:
    # Below the lock, deletion itself tolerates a concurrent remover (a discard, or a
    # collector on another host): whatever vanished counts as deleted. Every collection
    # takes the lock, so the race is between the walks themselves (payload_gc/_tree.py).
    _make_tree(tmp_path, 4, 200)
    root_fd = open_root(str(tmp_path))
    root_mount = fd_mount_id(root_fd)
    tallies = [Tally() for _ in range(4)]
    results: list[bool] = []

    def remove_all(tally: Tally) -> None:
        results.extend(remove_tree(root_fd, f"v{v}", f"v{v}", root_mount, tally) for v in range(4))

    threads = [threading.Thread(target=remove_all, args=(t,)) for t in tallies]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(root_fd)
    assert all(results)
    assert [t.problems for t in tallies] == [[]] * 4
    # Every file was counted by exactly one remover.
    assert sum(t.files for t in tallies) == 4 * 200
    assert _versions(tmp_path) == []


def test_two_processes_at_once(tmp_path: Path) -> None:
    _make_tree(tmp_path, 20, 100)
    command = [sys.executable, "-m", "payload_gc", "--root", str(tmp_path), "--below", "15"]
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outcomes = [(p.wait(60), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in outcomes)
    # Either one ran while the other held the lock (0 and 2), or they ran one after the
    # other (0 and 0); never an error or a traceback.
    assert codes in ([0, 0], [0, 2])
    for code, stdout, stderr in outcomes:
        if code == 2:
            assert stderr.count("\n") == 1
            # The loser saw the winner's lock written, or still being written.
            assert "is locked by pid" in stderr or "another collector is starting" in stderr
        else:
            assert stdout.startswith("deleted ")
            assert stderr == ""
    assert _versions(tmp_path) == [f"v{k}" for k in range(15, 20)]
    audit = (tmp_path / ".payload-gc" / "audit.jsonl").read_text().splitlines()
    assert len(audit) == codes.count(0)
    assert sum(json.loads(line)["dirs"] for line in audit) == 15


async def test_two_async_collectors_one_waits(tmp_path: Path) -> None:
    await trio.to_thread.run_sync(_make_tree, tmp_path, 10, 50)
    reports = []

    async def collect() -> None:
        reports.append(await collect_below(tmp_path, 8))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            nursery.start_soon(collect)
    assert sorted(r.dirs for r in reports) == [0, 8]
    assert all(r.outcome == "complete" for r in reports)
    assert await trio.to_thread.run_sync(_versions, tmp_path) == ["v8", "v9"]
