"""The daemon's shared, in-memory state and the staleness gate (docs/design.md §3).

All components run in one trio thread, so plain attributes are safe as long as no
`await` separates a read from the write that depends on it. Components that wait for
"something changed" (a version applied, a batch shipped, a group finished) call
`wait_changed()`; whoever changes the state calls `notify()`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import trio
from payload_gc import FileRemoval

from orchestrator.core.staleness import Staleness
from orchestrator.daemon.payload_account import PayloadAccount, payload_file_key
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
    # The limit on rollouts in flight the dispatcher obeys: the adaptive one's latest
    # choice (orchestrator/core/inflight.py); None is `inference.max_inflight`.
    inflight_limit: int | None = None
    # The least allowance a group should be dispatched with (orchestrator/core/inflight.py):
    # batches that may ship while it runs before it is stale.
    min_allowance: int = 0
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
    # Payload bytes on disk by the daemon's running account (no walk of the root: see
    # orchestrator/daemon/payload_account.py), and the most the account ever held: its
    # value right before a collection, where disk use peaks.
    peak_payload_bytes: int = 0
    payload_bytes: int = 0
    payload_account: PayloadAccount = attrs.field(factory=PayloadAccount)
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

    def record_written(self, sizes: Mapping[tuple[int, str], int]) -> None:
        """Payload files a group's check found on disk, `(version, name) -> size`: counted
        as written, and entered in the account, except in versions already collected (a
        collection that ended while the check ran: those files are gone)."""
        self.files_written += len(sizes)
        self.bytes_written += sum(sizes.values())
        bound = self.bound
        if bound is not None:
            sizes = {key: size for key, size in sizes.items() if key[0] >= bound}
        self.payload_account.add(sizes)
        self._account_changed()

    def record_files_deleted(self, root: Path, paths: Iterable[str], removal: FileRemoval) -> None:
        """A discard or sweep was asked to delete `paths` (`<root>/v<k>/<name>`) and did
        what `removal` says: the files it deleted leave the account (those it left, in
        `removal.left`, stay)."""
        prefix = os.fspath(root)
        left = set(removal.left)
        keys = (payload_file_key(prefix, path) for path in paths)
        self.payload_account.remove(key for key in keys if key is not None and key not in left)
        self._account_changed()

    def record_collected(self, bound: int, *, failed: Iterable[int] = ()) -> None:
        """A collection removed every version below `bound`: their files leave the
        account (busy files it left behind included: they go once closed), except those
        of the `failed` versions, which it could not delete entirely (counted in full
        until a collection succeeds)."""
        self.payload_account.remove_below(bound, keep=failed)
        self._account_changed()

    def record_payload_bytes(self, total: int) -> None:
        """A measured total (a walk of the root, as at the end of a run), which replaces
        the account's figure until the account next changes."""
        self.payload_bytes = total
        self.peak_payload_bytes = max(self.peak_payload_bytes, total)

    def _account_changed(self) -> None:
        self.payload_bytes = self.payload_account.bytes
        self.peak_payload_bytes = max(self.peak_payload_bytes, self.payload_bytes)
