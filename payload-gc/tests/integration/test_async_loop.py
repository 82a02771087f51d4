"""The async API keeps the trio event loop running while it deletes thousands of files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio
from payload_gc import collect_below
from payload_trees import make_version

TICKS_WANTED = 20


def _make_version(root: Path, version: int, files: int) -> None:
    make_version(root, version, size=512, byte=b"p", names=[f"{i:05d}.bin" for i in range(files)])


async def test_the_loop_keeps_ticking_during_a_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await trio.to_thread.run_sync(_make_version, tmp_path, 0, 2000)
    ticks = 0
    ticks_while_deleting = 0
    deleting = threading.Event()
    enough_ticks = threading.Event()
    done = trio.Event()
    real_unlink = os.unlink

    def unlink(path: str, *, dir_fd: int | None = None) -> None:
        # The deleting thread waits at its first payload file until the loop has woken up
        # many times while it was busy: that only happens if the deletion does not hold
        # up the event loop (a collector deleting on the loop thread would hang here and
        # fail).
        if path.endswith(".bin") and not deleting.is_set():
            deleting.set()
            assert enough_ticks.wait(20), "the event loop did not run while a deletion was busy"
        real_unlink(path, dir_fd=dir_fd)

    async def ticker() -> None:
        nonlocal ticks, ticks_while_deleting
        while not done.is_set():
            await trio.sleep(0.001)
            ticks += 1
            if deleting.is_set():
                ticks_while_deleting += 1
                if ticks_while_deleting >= TICKS_WANTED:
                    enough_ticks.set()

    monkeypatch.setattr(os, "unlink", unlink)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        report = await collect_below(tmp_path, 1, max_workers=1)
        done.set()
    assert report.files == 2000
    assert report.deleted[0].name == "v0"
    assert ticks_while_deleting >= TICKS_WANTED
    assert ticks >= ticks_while_deleting
