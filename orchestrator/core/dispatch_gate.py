"""Whether the dispatcher may start another group now (docs/design.md §3, "Dispatching only
what can finish fresh"): the arithmetic of the dispatch gate, pure.

The dispatcher reads the run into a `Pipe` and asks `DispatchGate.may_start`; the adaptive
in-flight limit (`orchestrator.core.inflight`) supplies `limit` and `min_allowance`; the
staleness rule (`orchestrator.core.staleness`) says what is fresh and what allowance a
group has.
"""

from __future__ import annotations

import attrs

from orchestrator.core.staleness import Staleness


@attrs.frozen
class Pipe:
    """What the gate reads of the run at one moment."""

    applied_version: int
    next_step: int  # the batch being filled
    inflight_rollouts: int  # dispatched, not yet taken by the sink
    queued_samples: int  # in the sink, not yet shipped
    limit: int  # the in-flight limit in force (rollouts)
    min_allowance: int = 0  # the adaptive limit's hold
    ending: bool = False  # stopping, or every batch shipped
    # The batches the run has still to fill, the one being filled included (None: the run
    # has no last step).
    batches_left: int | None = None


@attrs.frozen
class DispatchGate:
    """The rule for starting a group of `group_size` rollouts into batches of `batch_size`."""

    staleness: Staleness
    batch_size: int
    group_size: int

    def may_start(self, pipe: Pipe) -> bool:
        """A new group may start when all of these hold:

        - the run is not ending, and the batch being filled may ship (the gate is open);
        - the group fits under the in-flight limit;
        - its allowance is at least the hold (`enough_allowance`);
        - the work in the pipe (queued + in flight) is short of the batches a group
          dispatched now can still go into fresh: those the gate allows to fill
          (`a + 1`), and no more than `allowance + 1` (with `m = a` and shipping at the
          gate's furthest, only the batch being filled): anything beyond would only grow
          stale; and no more than the batches the run has left: at its end, anything
          beyond would only be stopped (a group discarded reopens the gate, so the last
          batch still fills).
        """
        staleness = self.staleness
        if pipe.ending or not staleness.may_ship(pipe.next_step, pipe.applied_version):
            return False
        if pipe.inflight_rollouts + self.group_size > pipe.limit:
            return False
        allowance = staleness.allowance(pipe.applied_version, pipe.next_step)
        if not self.enough_allowance(allowance, pipe.min_allowance):
            return False
        fresh_batches = min(staleness.batches_in_flight, allowance + 1)
        if pipe.batches_left is not None:
            fresh_batches = min(fresh_batches, pipe.batches_left)
        return pipe.queued_samples + pipe.inflight_rollouts < self.batch_size * fresh_batches

    def enough_allowance(self, allowance: int, min_allowance: int) -> bool:
        """Whether a group with `allowance` may see as many batches ship as a typical group
        does before it would be stale (`min_allowance`). Capped at `m`, the allowance a
        group has once the trainer has caught up: holding never stops the run, it waits
        for a version."""
        return allowance >= min(min_allowance, self.staleness.max_off_policy_steps)
