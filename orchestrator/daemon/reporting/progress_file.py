"""`progress.json`: the run's figures on disk for `orchestrator status` (docs/design.md §5),
saved after every shipped batch, collection, stall warning and progress line."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from orchestrator.core.sink import TrainSink
from orchestrator.daemon.reporting.no_progress import ProgressWatch
from orchestrator.daemon.reporting.progress_report import ProgressReporter
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot, snapshot
from orchestrator.daemon.reporting.stall import StallWatch
from orchestrator.daemon.run_state import RunState
from orchestrator.handoff import Progress, save_progress


@attrs.frozen
class RunFigures:
    """The run's parts that its figures are read from: state, sink, the stall watch, the
    progress line and the watch that stops a run without progress (on trio's clock)."""

    state: RunState
    sink: TrainSink
    stall: StallWatch
    reporter: ProgressReporter
    batch_size: int
    max_inflight: int
    watch: ProgressWatch

    @property
    def inflight_limit(self) -> int:
        return self.state.limits.in_force(self.max_inflight)

    def snapshot(self) -> RunSnapshot:
        """What the stall watch and the progress line read of the run now."""
        return snapshot(
            self.state, self.sink, needed=self.batch_size, inflight_limit=self.inflight_limit
        )

    def progress(self) -> Progress:
        """The run now, as `progress.json` holds it (times turned into Unix times)."""
        state, sink = self.state, self.sink
        return Progress(
            step=state.shipping.last_shipped,
            applied_version=state.versions.applied,
            bound=state.versions.collected_below,
            inflight_rollouts=state.dispatch.inflight_rollouts,
            inflight_limit=self.inflight_limit,
            queued_samples=sink.queued_samples,
            discards=dict(sink.counters),
            updated_at=time.time(),
            pid=os.getpid(),
            prompts_drawn=state.dispatch.prompts_drawn,
            **self._stall_part(),
            **self._report_part(),
        )

    def _stall_part(self) -> dict[str, Any]:
        """The stall watch's part (wall-clock times)."""
        stall, now, wall = self.stall, trio.current_time(), time.time()
        recent = stall.recent(self.snapshot())
        shipped_at = stall.shipped_at
        return {
            "started_at": wall - (now - stall.started_at),
            "last_shipped_at": None if shipped_at is None else wall - (now - shipped_at),
            "failures": dict(self.state.dispatch.failures),
            "recent_discards": dict(recent.discards),
            "recent_failures": dict(recent.failures),
            "top_error": recent.top_error,
        }

    def _report_part(self) -> dict[str, Any]:
        """The progress line's part (a wall-clock time)."""
        reporter, at = self.reporter, self.reporter.last_at
        return {
            "needed_samples": self.batch_size,
            "last_report": reporter.last,
            "last_report_at": None if at is None else time.time() - (trio.current_time() - at),
        }


@attrs.frozen
class ProgressFile:
    """Saves `figures.progress()` into `<state_dir>/progress.json`, in a worker thread."""

    state_dir: Path
    figures: RunFigures
    limiter: trio.CapacityLimiter

    async def save(self) -> None:
        progress = self.figures.progress()
        await trio.to_thread.run_sync(save_progress, self.state_dir, progress, limiter=self.limiter)
