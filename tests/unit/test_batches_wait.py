"""wait_for_batch: returns at once for a shipped batch, wakes on events and on a timer."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import trio

from orchestrator.handoff import is_complete_batch, publish_batch, wait_for_batch


async def test_returns_at_once_when_the_batch_is_shipped(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    batch_dir = publish_batch(tmp_path, 3, [], fsync=False)
    start = trio.current_time()
    assert await wait_for_batch(tmp_path, 3) == batch_dir
    assert trio.current_time() == start


def _silent_watcher(
    calls: list[dict[str, Any]],
) -> Any:
    """A stand-in for watchfiles.awatch that never reports a change, only timeouts.

    It is what a watcher looks like when the event announcing the batch was missed: the
    periodic re-check alone must find the batch.
    """

    async def awatch(path: Path, **options: Any) -> AsyncGenerator[set[tuple[int, str]], None]:
        calls.append({"path": path, **options})
        while True:
            await trio.sleep(options["rust_timeout"] / 1000)
            yield set()

    return awatch


async def test_a_missed_event_is_caught_by_the_periodic_check(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("watchfiles.awatch", _silent_watcher(calls))

    async def check_in_loop(batch_dir: Path, is_shipped: object, limiter: object) -> bool:
        # The autojump clock jumps while a worker thread runs, which would move the
        # checks off their schedule: check on the loop (tmp_path is a local disk).
        assert is_shipped is is_complete_batch
        return is_complete_batch(batch_dir)

    monkeypatch.setattr("orchestrator.handoff.wait._is_shipped", check_in_loop)
    start = trio.current_time()
    found: list[tuple[float, Path]] = []

    async def waiter() -> None:
        batch_dir = await wait_for_batch(tmp_path, 2, force_polling=True, poll_interval_s=0.25)
        found.append((trio.current_time() - start, batch_dir))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(2.5)
        publish_batch(tmp_path, 1, [], fsync=False)  # not the one it waits for
        await trio.sleep(0.9)
        publish_batch(tmp_path, 2, [], fsync=False)
    # Shipped at 3.4 s; the checks run every 0.25 s, so it is seen at 3.5 s.
    assert found == [(3.5, tmp_path / "step_000002")]
    [options] = calls
    assert options["path"] == tmp_path
    assert options["force_polling"] is True
    assert options["poll_delay_ms"] == 250
    assert options["rust_timeout"] == 250
    assert options["yield_on_timeout"] is True
    assert options["recursive"] is False


async def test_a_missing_batches_dir_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await wait_for_batch(tmp_path / "missing", 1, poll_interval_s=0.01)


async def test_the_watcher_wakes_at_least_every_half_second(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("watchfiles.awatch", _silent_watcher(calls))
    with trio.move_on_after(1.0):
        await wait_for_batch(tmp_path, 1, poll_interval_s=60.0)
    [options] = calls
    assert options["force_polling"] is False
    assert options["poll_delay_ms"] == 60_000
    assert options["rust_timeout"] == 500
