"""The shipper: every batch the sink can fill and the staleness gate allows goes to the
trainer as soon as it can (docs/design.md §3, §5), in the hand-off format the daemon was
given (`run_daemon`'s `handoff`, the registry's format for `[trainer] format`), with one
canonical `shipped batch` line and one line of `<run_dir>/steps.jsonl` (what
`orchestrator report` draws).

The format writes the step from the samples, in a worker thread (`ship_step`): "native"
`<batches_dir>/step_000007/batch.bin`, "prime-rl" prime-rl's `<rollouts_dir>/step_7/rank_R.bin`
per data rank (reading the routed experts in that thread). The shipper only sees a
`Shipment`."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.rollouts import TrainSample
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.admission import Admission
from orchestrator.daemon.payload_files.disk import PayloadDeleter
from orchestrator.daemon.reporting.progress_file import ProgressFile, RunFigures
from orchestrator.daemon.reporting.run_lines import RunLines
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.run_totals import RunTotals, run_totals
from orchestrator.handoff import HandoffFormat, HandoffSettings, NothingToShip, Shipment

log = structlog.get_logger(__name__)


@attrs.frozen
class Shipper:
    config: Config
    handoff: HandoffFormat
    state: RunState
    sink: TrainSink
    deleter: PayloadDeleter
    admission: Admission
    figures: RunFigures
    progress: ProgressFile
    lines: RunLines

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ship whatever is ready, then again at every change of the run, until cancelled."""
        task_status.started()
        while True:
            changed = self.state.changed()
            await self.ship_ready()
            await changed.wait()

    async def ship_ready(self) -> None:
        """Ship batches while the next one is full and the gate lets it go."""
        state, sink, shipping = self.state, self.sink, self.state.shipping
        while (
            not shipping.done
            and state.may_ship(shipping.next_step)
            and sink.ready(shipping.next_step)
        ):
            step = shipping.next_step
            samples, pruned = sink.assemble(step)
            # Out of the sink and not shipped yet: the gate must not see room in this batch.
            shipping.writing = True
            try:
                await self.deleter.delete(pruned, reason="discard")
                shipment = await ship_step(
                    self.handoff, self.config.handoff_settings, step, samples
                )
            except NothingToShip:
                # Each sample was logged as it was dropped. The step stays next: new
                # samples fill it again (the queue gave these up; their files stay pinned
                # for the collector).
                sink.unship(samples)
                log.warning(
                    "batch not shipped: no sample's payload could be read",
                    step=step,
                    dropped=len(samples),
                )
                state.notify()
                continue
            finally:
                shipping.writing = False
            if shipment.dropped:
                sink.unship([samples[dropped.index] for dropped in shipment.dropped])
            shipping.next_step = step + 1
            self.figures.stall.shipped(trio.current_time(), self.figures.snapshot())
            self.admission.batch_shipped()
            state.notify()
            await self.progress.save()
            totals = run_totals(self.state, self.sink)
            self._log_shipped(step, samples, shipment, totals)
            await self.lines.step(self.step_line(step, samples, shipment, totals))

    def step_line(
        self, step: int, samples: list[TrainSample], shipment: Shipment, totals: RunTotals
    ) -> dict[str, Any]:
        """The `steps.jsonl` line of a shipped batch: its samples' rewards (by env) and
        staleness, and the run's running totals then (rollouts, discards, failures,
        payload bytes and deletions), from which the report draws rates and curves."""
        by_env: defaultdict[str, list[float]] = defaultdict(list)
        for sample in samples:
            by_env[sample.env].append(sample.reward)
        rewards = [sample.reward for sample in samples]
        staleness = [step - 1 - sample.start_version for sample in samples]
        return {
            "step": step,
            "time": round(time.time(), 3),
            "version": totals.applied_version,
            "samples": shipment.samples,
            "reward_mean": _mean(rewards),
            "reward_by_env": {env: _mean(values) for env, values in sorted(by_env.items())},
            "staleness_max": max(staleness, default=0),
            "staleness_mean": _mean(staleness),
            "rollouts": totals.rollouts,
            "failures": totals.failures,
            "discards": totals.discards,
            "inflight_limit": self.figures.inflight_limit,
            "payload_bytes": totals.payload_bytes,
            "payload_files": totals.payload_files,
            "bytes_deleted": totals.bytes_deleted,
            "files_deleted": totals.files_deleted,
            "collected_below": totals.collected_below,
        }

    def _log_shipped(
        self, step: int, samples: list[TrainSample], shipment: Shipment, totals: RunTotals
    ) -> None:
        extra = (
            {}
            if shipment.micro_batches is None
            else {
                "micro_batches_per_rank": shipment.micro_batches,
                "dropped": len(shipment.dropped),
            }
        )
        log.info(
            "shipped batch",
            step=step,
            version=totals.applied_version,
            samples=shipment.samples,
            groups=len({s.group_id for s in samples}),
            staleness=max(step - 1 - s.start_version for s in samples),
            discards=totals.discards,
            files_deleted=sum(totals.files_deleted.values()),
            # The running account (docs/design.md §8): the root is not walked.
            payload_files=totals.payload_files,
            payload_bytes=totals.payload_bytes,
            batch=str(shipment.path),
            **extra,
        )


def _mean(values: list[float] | list[int]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


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
