"""Waiting for a step to be shipped: filesystem events, with polling as the safety net.

`wait_for_step_dir` waits for a step of any format (`HandoffFormat.is_step_shipped`);
`wait_for_batch` for a native batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import trio
import watchfiles

from orchestrator.handoff.native import batch_step_dir, is_complete_batch

_MAX_WAKE_MS = 500


async def wait_for_batch(
    batches_dir: Path,
    step: int,
    *,
    force_polling: bool = False,
    poll_interval_s: float = 1.0,
    limiter: trio.CapacityLimiter | None = None,
) -> Path:
    """Wait until batch `step` is shipped in `batches_dir`; return its directory.

    Checks at once, then watches `batches_dir` with watchfiles and checks again on every
    change, and without one at least every `poll_interval_s` (0.5 s at most): an event
    can be missed (the batch may land between the first check and the watcher's start;
    inotify never sees a rename made on another NFS host), and a missed event must not
    stall the trainer. `force_polling` makes watchfiles poll every `poll_interval_s`
    instead of using inotify, which is what NFS needs. `batches_dir` must exist.

    Put a deadline at the call site (`with trio.fail_after(...)`) to bound the wait; a
    cancelled wait ends within 0.5 s. Raises OSError (FileNotFoundError when
    `batches_dir` is missing).
    """
    return await wait_for_step_dir(
        batches_dir,
        batch_step_dir(batches_dir, step),
        is_complete_batch,
        force_polling=force_polling,
        poll_interval_s=poll_interval_s,
        limiter=limiter,
    )


async def wait_for_step_dir(
    parent: Path,
    step_dir: Path,
    is_shipped: Callable[[Path], bool],
    *,
    force_polling: bool = False,
    poll_interval_s: float = 1.0,
    limiter: trio.CapacityLimiter | None = None,
) -> Path:
    """Wait until `is_shipped(step_dir)` (a blocking check, run in a worker thread) holds
    for the step directory `step_dir` in `parent`; return `step_dir`. The same watching
    and polling as `wait_for_batch`, for any step layout (prime-rl's trainer waits for its
    `rollouts/step_7/rank_R.bin`). Raises OSError (FileNotFoundError when `parent` is
    missing)."""
    if await _is_shipped(step_dir, is_shipped, limiter):
        return step_dir
    interval_ms = max(1, round(poll_interval_s * 1000))
    # The watcher's thread cannot be cancelled: it returns (and a cancelled wait ends)
    # only at its next timeout. Keep that short whatever the poll interval.
    wake_ms = min(interval_ms, _MAX_WAKE_MS)
    changes = watchfiles.awatch(
        parent,
        # A shipped step appears as one rename in the parent directory itself.
        recursive=False,
        force_polling=force_polling,
        poll_delay_ms=interval_ms,
        # Wake up even without events (an empty set), to check again.
        rust_timeout=wake_ms,
        yield_on_timeout=True,
        # The default filter ignores names we do not care about either way; keep all.
        watch_filter=None,
        # Report a change at once instead of grouping changes for up to 1.6 s.
        debounce=interval_ms,
    )
    async with contextlib.aclosing(changes) as parent_changes:
        async for _ in parent_changes:
            if await _is_shipped(step_dir, is_shipped, limiter):
                return step_dir
    # awatch only ends when its stop event is set, which we never do.
    raise AssertionError("watchfiles.awatch ended without being stopped")


async def _is_shipped(
    step_dir: Path, is_shipped: Callable[[Path], bool], limiter: trio.CapacityLimiter | None
) -> bool:
    return await trio.to_thread.run_sync(is_shipped, step_dir, limiter=limiter)
