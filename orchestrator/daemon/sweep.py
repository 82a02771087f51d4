"""The sweep after each collection: queued groups that can no longer ship are dropped,
groups in flight that can no longer ship are stopped, their files freed (docs/design.md
§6)."""

from __future__ import annotations

import attrs

from orchestrator.core.sink import TrainSink
from orchestrator.daemon.payload_files.disk import PayloadDeleter
from orchestrator.daemon.reporting.progress_file import ProgressFile
from orchestrator.daemon.run_state import RunState


@attrs.frozen
class Sweeper:
    state: RunState
    sink: TrainSink
    deleter: PayloadDeleter
    progress: ProgressFile

    async def sweep(self) -> None:
        """Drop queued groups that can no longer ship, stop in-flight ones, free files."""
        state, sink = self.state, self.sink
        swept = sink.counters["swept"]
        files = sink.drop_stale(state.shipping.next_step)
        step = state.shipping.next_step
        stopped = 0
        for group in list(state.dispatch.groups.values()):
            if not state.staleness.is_fresh(group.start_version, step) and not group.stop.is_set():
                group.stop.set()
                stopped += 1
        bound = state.versions.collected_below
        if bound is not None:
            sink.forget_versions_below(bound)
        await self.deleter.delete(files, reason="sweep")
        if files or stopped or sink.counters["swept"] != swept:
            # What `orchestrator status` shows changed; a sweep that changed nothing (most,
            # in a steady run) leaves progress.json to the next shipped batch.
            await self.progress.save()
        state.notify()

    async def drop_everything_queued(self) -> None:
        """At the end of a run: nothing queued will ever ship, so free its files now."""
        await self.deleter.delete(self.sink.drop_all(), reason="discard")
