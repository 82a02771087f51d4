"""The daemon's shared, in-memory state and the staleness gate (docs/design.md §3).

All components run in one trio thread, so plain attributes are safe as long as no
`await` separates a read from the write that depends on it. Components that wait for
"something changed" (a version applied, a batch shipped, a group finished) call
`wait_changed()`; whoever changes the state calls `notify()`.
"""

from __future__ import annotations

from collections import Counter

import attrs
import trio

from orchestrator.core.staleness import Staleness
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
class RunState:
    """Versions, steps, in-flight work and counters of one daemon run."""

    staleness: Staleness
    max_steps: int  # 0: run until stopped
    applied_version: int = 0
    # The last version whose update finished: applied, collected and swept.
    settled_version: int = 0
    next_step: int = 1  # the batch being filled
    bound: int | None = None  # the last collection bound
    inflight_rollouts: int = 0
    groups: dict[str, InflightGroup] = attrs.field(factory=dict)
    # Outcomes of rollouts ("completed", "failed", "poisoned") and failures by kind.
    rollouts: Counter[str] = attrs.field(factory=Counter)
    failures: Counter[str] = attrs.field(factory=Counter)
    # Every failure is recorded through this (its counts are `failures` itself).
    rejections: Rejections = attrs.field(
        default=attrs.Factory(lambda self: Rejections(self.failures), takes_self=True)
    )
    # Files and bytes deleted, by path: "discard", "sweep", "collection", "wipe".
    files_deleted: Counter[str] = attrs.field(factory=Counter)
    bytes_deleted: Counter[str] = attrs.field(factory=Counter)
    files_written: int = 0
    bytes_written: int = 0
    peak_payload_bytes: int = 0
    payload_bytes: int = 0
    stopping: bool = False
    # The model's routing shape every reply is checked against: from the config, or fixed
    # by the first reply of the run that carries routing (None until then).
    routing_shape: RoutingShape | None = None
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def notify(self) -> None:
        """Wake every task waiting in `wait_changed`."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def changed(self) -> trio.Event:
        """The event the next `notify()` sets. Take it *before* doing work that may await,
        then wait on it, so a change made meanwhile is not missed."""
        return self._changed

    @property
    def done_shipping(self) -> bool:
        return self.max_steps > 0 and self.next_step > self.max_steps

    def may_ship(self, step: int) -> bool:
        """The `max_async_steps` gate: batch `step` ships once the applied version is
        at least `step - 1 - max_async_steps`."""
        return self.staleness.may_ship(step, self.applied_version)

    def may_start_groups(self) -> bool:
        """New groups start only while the batch being filled could ship."""
        return not self.stopping and not self.done_shipping and self.may_ship(self.next_step)

    @property
    def fresh_bound(self) -> int:
        """The oldest group start version the batch being filled may contain."""
        return self.staleness.min_fresh_version(self.next_step)

    @property
    def collection_bound(self) -> int:
        """The bound of the collection that follows applying `applied_version`: versions
        below it are deleted, or about to be (`bound` is set once that collection ends)."""
        return self.staleness.collection_bound(self.applied_version)

    def record_payload_bytes(self, total: int) -> None:
        self.payload_bytes = total
        self.peak_payload_bytes = max(self.peak_payload_bytes, total)
