"""Admission: every finished group goes into the sink, from its own task (`admit`), and
the files of what the sink discards are deleted at once; what the adaptive in-flight limit
learns from each group and decides after each shipped batch (orchestrator/core/inflight.py)
is written into `RunState.limits`."""

from __future__ import annotations

import attrs
import structlog
import trio

from orchestrator.core.inflight import InflightLimit
from orchestrator.core.rollouts import GroupResult
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.payload_files.disk import PayloadDeleter
from orchestrator.daemon.run_state import RunState

log = structlog.get_logger(__name__)


@attrs.define
class Admission:
    """Takes finished groups into the sink; owns the adaptive in-flight limit."""

    state: RunState
    sink: TrainSink
    deleter: PayloadDeleter
    inflight: InflightLimit

    def start(self) -> None:
        """Dispatching begins now: the limit's clock starts, its first value is in force."""
        self.inflight.started(trio.current_time())
        self.state.limits.rollouts = self.inflight.limit

    async def admit(self, group: GroupResult) -> None:
        """Take a finished group into the sink; delete the files of what it discards.

        Called by the group's own task, so that the group is in flight or in the sink at
        every moment the dispatch gate looks (never between the two)."""
        self._observe_turnaround(group)
        files = self.sink.admit(group, self.state.shipping.next_step)
        self.state.notify()
        await self.deleter.delete(files, reason="discard")

    def batch_shipped(self) -> None:
        """A batch shipped: the adaptive limit may decide anew (logged when it changes)."""
        decision = self.inflight.shipped(trio.current_time())
        if decision is None:
            return
        limits = self.state.limits
        limits.rollouts = decision.limit
        limits.min_allowance = decision.min_allowance
        if decision.changed:
            log.info(
                "inflight limit",
                limit=decision.limit,
                previous=decision.previous,
                min_allowance=decision.min_allowance,
                turnaround_p90_s=round(decision.turnaround_p90_s, 3),
                slack_used_p90=round(decision.slack_used_p90, 2),
                step_time_s=round(decision.step_time_s, 3),
                inflight_mean=round(decision.inflight_mean, 1),
                groups=decision.groups,
                stale_groups=decision.stale_groups,
            )
            self.state.notify()

    def _observe_turnaround(self, group: GroupResult) -> None:
        """What the in-flight limit learns from a group the sink is about to take."""
        if group.dispatched_at is None or group.dispatched_step is None:
            return
        staleness = self.state.staleness
        self.inflight.group_admitted(
            trio.current_time() - group.dispatched_at,
            allowance=staleness.allowance(group.start_version, group.dispatched_step),
            stale=not staleness.is_fresh(group.start_version, self.state.shipping.next_step),
        )
