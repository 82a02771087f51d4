"""How the daemon ships a step: in the hand-off format it was given (`run_daemon`'s
`handoff`, the registry's format for `[trainer] format`).

The format writes the step from the samples, in a worker thread: "native"
`<batches_dir>/step_000007/batch.bin`, "prime-rl" prime-rl's `<rollouts_dir>/step_7/rank_R.bin`
per data rank (reading the routed experts in that thread). The daemon only sees a
`Shipment`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import trio

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff import (
    HandoffFormat,
    HandoffSettings,
    NothingToShip,
    Shipment,
)

__all__ = ["NothingToShip", "Shipment", "ship_step"]


async def ship_step(
    handoff: HandoffFormat,
    settings: HandoffSettings,
    step: int,
    samples: Sequence[TrainSample],
) -> Shipment:
    """Ship step `step` of `samples` in `handoff`'s format, in a worker thread.

    Raises `BatchExists` when the step was shipped already, `NothingToShip` when the
    format dropped every sample (no payload could be read; nothing written), OSError
    when writing fails.
    """
    ship = functools.partial(handoff.ship, settings, step, samples)
    return await trio.to_thread.run_sync(ship)
