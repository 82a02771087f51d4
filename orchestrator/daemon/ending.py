"""How a run ends: once every batch is trained on, or when a stop is requested, the groups
in flight are drained (docs/design.md §7; `orchestrator.daemon.stop`)."""

from __future__ import annotations

import functools
import math

import structlog
import trio

from orchestrator.config import Config
from orchestrator.daemon.payload_files.disk import tree_bytes
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.stop import Stop
from orchestrator.handoff import HandoffFormat

log = structlog.get_logger(__name__)


async def account_for_a_stopped_run(
    config: Config, handoff: HandoffFormat, state: RunState, stop: Stop
) -> None:
    """What a run stopped by a request did: the bytes on disk, measured within what is
    left of the grace time, and the steps shipped."""
    with stop.grace():
        # A walk that only reads: a second request may abandon it.
        _, on_disk = await trio.to_thread.run_sync(
            functools.partial(tree_bytes, config.payload_root), abandon_on_cancel=True
        )
        state.payload.record_measured(on_disk)
    # A stop can land between a batch's rename into place and the daemon counting it:
    # the batch directories on disk are what was shipped (docs/design.md §5).
    with trio.CancelScope(shield=True):
        shipped = await trio.to_thread.run_sync(
            lambda: (
                handoff.shipped_steps(config.handoff_settings)
                if config.batches_dir.is_dir()
                else []
            )
        )
    shipping = state.shipping
    shipping.next_step = max(shipping.next_step, shipped[-1] + 1 if shipped else 1)
    log.info(
        "stopped",
        signal=stop.reason,
        last_shipped=shipping.last_shipped,
        next="start the same command again to resume",
    )


def stop_gracefully_when_asked(stop: Stop, state: RunState, nursery: trio.Nursery) -> None:
    """From now on a stop request lets the groups in flight end after their requests
    (within the grace time, or until a second request), then stops the run."""

    async def stop_when_asked() -> None:
        await stop.requested.wait()
        with stop.grace():
            await drain_groups(state, math.inf)
        stop.scope.cancel()

    stop.graceful = True
    nursery.start_soon(stop_when_asked)


async def wait_until_trained(state: RunState, max_steps: int) -> None:
    """Until the trainer has published (and the daemon applied and collected) `max_steps`."""
    while not (state.shipping.done and state.versions.settled >= max_steps):
        await state.wait_changed()
    log.info("all batches trained on", steps=max_steps, version=state.versions.applied)


async def drain_groups(state: RunState, deadline_s: float) -> None:
    """Nothing more can ship: stop every group after its requests in flight return (so
    their payload files are all written), cancelling what is still running at the deadline."""
    dispatch = state.dispatch
    dispatch.stopping = True
    for group in list(dispatch.groups.values()):
        group.stop.set()
    with trio.move_on_after(deadline_s):
        while dispatch.groups:
            await state.wait_changed()
    for group in list(dispatch.groups.values()):
        group.cancel_scope.cancel()
