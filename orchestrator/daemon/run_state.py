"""The daemon's shared, in-memory state, split by the service that writes each part.

All services run in one trio thread, so plain attributes are safe as long as no `await`
separates a read from the write that depends on it. Each part has one writer and any
number of readers:

- `Versions`: the policy watcher (what is applied, settled, collected below);
- `Shipping`: the shipper (the batch being filled);
- `Dispatch`: the dispatcher (the groups in flight, outcomes, failures, the routing shape);
- `InflightLimits`: admission (the in-flight limit it chose from what it saw);
- `Evaluation`: the evaluator (eval rollouts in flight, the evals done, the last one);
- `PayloadLedger`: the payload account, changed only through its `record_*` methods by
  whoever writes or deletes payload files.

Services that wait for "something changed" (a version applied, a batch shipped, a group
finished) call `wait_changed()`; whoever changes a part calls `notify()`.
"""

from __future__ import annotations

from collections import Counter

import attrs
import trio

from orchestrator.core.evals import EvalReport
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.payload_files.ledger import PayloadLedger
from orchestrator.daemon.rejections import Rejections
from orchestrator.payload import RoutingShape


@attrs.frozen
class InflightGroup:
    """A group whose rollouts are still running.

    `stop` asks its rollouts to end after the request each has in flight: the server then
    finishes writing that request's payload before it answers, so every file the group
    wrote is known and freed with it, and nothing is written into a version directory
    after it was collected. `cancel_scope` ends the group at once (shutdown).
    """

    group_id: str
    start_version: int
    server: str
    cancel_scope: trio.CancelScope
    stop: trio.Event = attrs.field(factory=trio.Event)


@attrs.define
class Changes:
    """The run's one "something changed" signal."""

    _event: trio.Event = attrs.field(factory=trio.Event)

    def notify(self) -> None:
        """Wake every task waiting in `wait_changed`."""
        self._event.set()
        self._event = trio.Event()

    async def wait_changed(self) -> None:
        await self._event.wait()

    def changed(self) -> trio.Event:
        """The event the next `notify()` sets. Take it *before* doing work that may await,
        then wait on it, so a change made meanwhile is not missed."""
        return self._event


@attrs.define
class Versions:
    """Written by the policy watcher."""

    # Rollouts dispatched now are tagged with it: every server has loaded it.
    applied: int = 0
    # The last version whose update finished: applied, collected and swept.
    settled: int = 0
    # The bound of the last finished collection: no `v<k>` below it is left.
    collected_below: int | None = None


@attrs.define
class Shipping:
    """Written by the shipper."""

    max_steps: int  # 0: run until stopped
    next_step: int = 1  # the batch being filled, until it is taken to be written
    # Batch `next_step` is taken from the sink and being written: what finishes now goes
    # into the one after.
    writing: bool = False

    @property
    def filling_step(self) -> int:
        """The batch a group that finishes now goes into: `next_step`, or the one after
        while `next_step` is written (the dispatch gate's view)."""
        return self.next_step + self.writing

    @property
    def done(self) -> bool:
        return self.max_steps > 0 and self.next_step > self.max_steps

    @property
    def batches_left(self) -> int | None:
        """The batches still to fill, `filling_step`'s included (None: no last step)."""
        return self.max_steps - self.filling_step + 1 if self.max_steps else None

    @property
    def last_shipped(self) -> int:
        return self.next_step - 1


@attrs.frozen
class Halt:
    """Why a run ended itself: `by` what ("refused", "no progress", "solved"), and the
    one line `orchestrator run` prints last (its exit status is 2)."""

    by: str
    line: str


@attrs.define
class Dispatch:
    """Written by the dispatcher (and by the end of the run, which stops it)."""

    # Prompts drawn from the environment (the next group's prompt is this index), and
    # those it skipped, by environment (a dataset row whose prompt does not fit).
    prompts_drawn: int = 0
    prompts_skipped: Counter[str] = attrs.field(factory=Counter)
    # Rollouts dispatched whose group the sink has not taken yet.
    inflight_rollouts: int = 0
    groups: dict[str, InflightGroup] = attrs.field(factory=dict)
    # Outcomes of rollouts ("completed", "failed", "poisoned", "stopped", "reward_failed")
    # and failures by kind; every failure is recorded through `rejections` (its counts are
    # `failures`).
    rollouts: Counter[str] = attrs.field(factory=Counter)
    failures: Counter[str] = attrs.field(factory=Counter)
    rejections: Rejections = attrs.field(
        default=attrs.Factory(lambda self: Rejections(self.failures), takes_self=True)
    )
    # No group starts any more: the run is ending.
    stopping: bool = False
    # The model's routing shape every reply is checked against: from the config, or fixed
    # by the first reply of the run that carries routing (None until then).
    routing_shape: RoutingShape | None = None
    # The reward failures' most common texts, by their kind ("raised", "timeout", ...):
    # the pool counts and logs them; what ends a run quotes them.
    reward_errors: Rejections = attrs.field(factory=Rejections)
    # Why the run ends itself, once it does (`halt`): the fleet refuses every request
    # (`orchestrator.core.refusals`), or nothing trainable comes any more
    # (`reporting/no_progress.py`); `halted` is set then.
    halt_reason: Halt | None = None
    halted: trio.Event = attrs.field(factory=trio.Event)

    def halt(self, by: str, line: str) -> bool:
        """End the run on its own: no group starts any more, and the run stops as a
        first signal stops it (`by` names what stopped it, `line` is the one line that
        says why). Returns whether this was the first halt (later ones change nothing)."""
        if self.halt_reason is not None:
            return False
        self.halt_reason = Halt(by, line)
        self.stopping = True
        self.halted.set()
        return True


@attrs.define
class Evaluation:
    """Written by the evaluator (`orchestrator.daemon.evaluation`)."""

    # Eval rollouts in flight: the dispatcher counts them against the in-flight limit.
    inflight: int = 0
    # The most that were ever in flight at once beside training (not after its end).
    peak_inflight: int = 0
    # The version the eval running now was started for (None: none runs).
    running: int | None = None
    # The last applied version the schedule looked at (None: not yet).
    looked_at: int | None = None
    evals: int = 0
    # Eval rollouts by outcome ("scored", "failed") and failures by kind.
    rollouts: Counter[str] = attrs.field(factory=Counter)
    failures: Counter[str] = attrs.field(factory=Counter)
    rejections: Rejections = attrs.field(
        default=attrs.Factory(lambda self: Rejections(self.failures), takes_self=True)
    )
    # The last eval's report.
    last: EvalReport | None = None


@attrs.define
class InflightLimits:
    """Written by admission, from the adaptive limit's decisions (orchestrator/core/inflight.py)."""

    # The limit on rollouts in flight the dispatcher obeys; None is `inference.max_inflight`.
    rollouts: int | None = None
    # The least allowance a group should be dispatched with: batches that may ship while it
    # runs before it is stale.
    min_allowance: int = 0

    def in_force(self, max_inflight: int) -> int:
        """The limit on rollouts in flight now (`max_inflight` until admission set one)."""
        return max_inflight if self.rollouts is None else self.rollouts


@attrs.frozen
class RunState:
    """Versions, steps, in-flight work and counters of one daemon run, by writer."""

    staleness: Staleness
    shipping: Shipping
    versions: Versions = attrs.field(factory=Versions)
    dispatch: Dispatch = attrs.field(factory=Dispatch)
    limits: InflightLimits = attrs.field(factory=InflightLimits)
    evaluation: Evaluation = attrs.field(factory=Evaluation)
    payload: PayloadLedger = attrs.field(factory=PayloadLedger)
    changes: Changes = attrs.field(factory=Changes)

    @classmethod
    def new(
        cls,
        staleness: Staleness,
        *,
        max_steps: int = 0,
        routing_shape: RoutingShape | None = None,
    ) -> RunState:
        """The state of a run that has done nothing yet."""
        return cls(staleness, Shipping(max_steps), dispatch=Dispatch(routing_shape=routing_shape))

    def notify(self) -> None:
        self.changes.notify()

    async def wait_changed(self) -> None:
        await self.changes.wait_changed()

    def changed(self) -> trio.Event:
        return self.changes.changed()

    # -- what follows from the parts and the staleness rule -------------------------------

    @property
    def training_over(self) -> bool:
        """No batch is filled any more: the last one shipped, or the run is stopping."""
        return self.dispatch.stopping or self.shipping.done

    def may_ship(self, step: int) -> bool:
        """The `max_async_steps` gate for batch `step`, at the applied version."""
        return self.staleness.may_ship(step, self.versions.applied)

    @property
    def collecting_below(self) -> int:
        """The bound of the collection that follows applying the applied version: versions
        below it are deleted, or about to be (`versions.collected_below` once it ends)."""
        return self.staleness.collection_bound(self.versions.applied)
