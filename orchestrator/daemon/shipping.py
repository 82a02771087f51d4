"""The one place that chooses how a step is shipped: `[trainer] format`.

"native" publishes `<batches_dir>/step_000007/batch.bin` (`publish_batch`); "prime-rl"
publishes prime-rl's `<rollouts_dir>/step_7/rank_R.bin` per data rank
(`publish_primerl_step`), reading the routed experts in the worker thread that writes
them. Either runs in a worker thread; the daemon only sees a `Shipment`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from orchestrator.config import Config
from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff import DroppedSample, publish_batch_async
from orchestrator.handoff.formats import shipped_steps_in
from orchestrator.handoff.primerl.store import NothingToShip, publish_primerl_step_async

__all__ = ["NothingToShip", "Shipment", "ship_step", "shipped_steps_of"]


@attrs.frozen
class Shipment:
    """A shipped step: its directory, the samples in it, those left out for an unreadable
    payload (prime-rl only: the native trainer reads payloads itself), and the micro
    batches per data rank (prime-rl only)."""

    path: Path
    samples: int
    dropped: tuple[DroppedSample, ...] = ()
    micro_batches: int | None = None


async def ship_step(config: Config, step: int, samples: Sequence[TrainSample]) -> Shipment:
    """Ship step `step` of `samples` in the config's format, in a worker thread.

    Raises `BatchExists` when the step was shipped already, `NothingToShip` (prime-rl)
    when no sample's payload could be read (nothing written), OSError when writing fails.
    """
    if config.trainer.format == "prime-rl":
        shipped = await publish_primerl_step_async(
            config.batches_dir,
            step,
            samples,
            data_world_size=config.trainer.data_world_size,
            seq_len=config.train_seq_len,
            env_name=config.env.name,
        )
        return Shipment(shipped.path, shipped.samples, shipped.dropped, shipped.micro_batches)
    path = await publish_batch_async(config.batches_dir, step, samples)
    return Shipment(path, len(samples))


def shipped_steps_of(config: Config) -> list[int]:
    """The steps shipped in the config's batches directory and format, sorted. Blocking.
    Raises OSError when the directory exists but cannot be listed."""
    return shipped_steps_in(
        config.batches_dir,
        batch_format=config.trainer.format,
        data_world_size=config.trainer.data_world_size,
    )
