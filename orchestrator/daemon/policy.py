"""Policy updates: watch `weights/`, make every server load the new version, apply it,
collect payload versions below the bound, then sweep stale groups (docs/design.md §3, §5).

Versions are read, and servers told which directory to load, in the trainer's layout
(`[trainer] weights_layout`: `step_000007`, or prime-rl's `step_7`).

The order is the guarantee: a version is applied only after every inference server has
loaded it, and `v<k>` directories are collected only once the version is applied, with
the bound `min_fresh_version(N + 1, m)`, below which no unread batch can reference a file.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable

import attrs
import structlog
import trio
import watchfiles
from payload_gc import PayloadGCError, collect_below, parse_version

from orchestrator.config import Config
from orchestrator.daemon.heap import trim_heap
from orchestrator.daemon.inference.client import load_weights
from orchestrator.daemon.inference.http11 import Requester
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.metrics import CollectionTimes
from orchestrator.daemon.run_state import RunState
from orchestrator.handoff import newest_published_version, weights_step_dir
from orchestrator.wire import InferenceFailure, weight_update_plan

log = structlog.get_logger(__name__)


#: The longest one collection may take before the run stops with an error.
COLLECT_DEADLINE_S = 3600.0

# The longest the filesystem watcher's thread blocks, so cancelling it never waits longer.
_WATCHER_WAKE_MS = 500


async def broadcast_update_weights(
    client: Requester, config: Config, pool: ServerPool, version: int
) -> list[str] | None:
    """Tell every healthy server to load `version` by `[inference] weight_update`'s
    protocol, concurrently, with retries (nothing with "none"). Returns the URLs of the
    servers that loaded it, in the pool's order (None: the protocol loads nothing).

    A server that still fails after `retries` attempts is marked down: it gets the
    version from the health prober when it comes back, and no group is pinned to it
    meanwhile. Never raises for a failing server (the prober's deadline decides when
    having no server at all is fatal).
    """
    weight_dir = weights_step_dir(config.weights_dir, version, layout=config.trainer.weights_layout)
    plan = weight_update_plan(config.inference.weight_update, weight_dir, version)
    if not plan.calls:
        return None
    loaded: set[str] = set()

    async def update(url: str) -> None:
        for attempt in range(config.inference.retries + 1):
            try:
                with trio.fail_after(config.inference.request_timeout_s):
                    await load_weights(client, url, plan)
                loaded.add(url)
                return
            except (InferenceFailure, trio.TooSlowError) as exc:
                error = str(exc) or "no answer in time"
                log.warning(
                    "weight update failed",
                    url=url,
                    version=version,
                    protocol=config.inference.weight_update,
                    error=error,
                )
            await trio.sleep(min(config.inference.retry_backoff_s * 2**attempt, 10.0))
        pool.mark_down(url, f"did not load v{version}")

    healthy = list(pool.healthy())
    async with trio.open_nursery() as nursery:
        for url in healthy:
            nursery.start_soon(update, url)
    return [url for url in healthy if url in loaded]


@attrs.define
class PolicyWatcher:
    """Applies new policy versions as the trainer publishes them; see `serve`."""

    config: Config
    state: RunState
    client: Requester
    pool: ServerPool
    # Called after each collection: sweeps the sink and cancels groups that cannot ship.
    sweep: Callable[[], Awaitable[None]]
    file_limiter: trio.CapacityLimiter
    # Given when metrics are on: receives each collection's duration.
    collection_times: CollectionTimes | None = None
    # Whether the last probe for new weights failed (logged once, not at every probe).
    _probe_failing: bool = attrs.field(default=False, init=False)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Look for new versions until cancelled; apply each in order of arrival.

        A probe (`check_for_new_version`) runs at once, then every
        `trainer.poll_interval_s`, and also as soon as the filesystem watcher sees a
        change in `weights/` (inotify: local writes only). With `trainer.force_polling`
        there is no watcher: the timed probes are the polling, and they open exact paths,
        which a network filesystem revalidates (docs/design.md §5, Shared filesystems).
        """
        config = self.config
        await trio.to_thread.run_sync(lambda: config.weights_dir.mkdir(parents=True, exist_ok=True))
        # Capacity 1: changes seen while a probe runs make one more probe, not a backlog.
        wake_send, wake_receive = trio.open_memory_channel[None](1)
        async with trio.open_nursery() as nursery:
            if not config.trainer.force_polling:
                nursery.start_soon(self._watch, wake_send)
            task_status.started()
            while True:
                await self.check_for_new_version()
                with trio.move_on_after(config.trainer.poll_interval_s):
                    await wake_receive.receive()

    async def _watch(self, wake: trio.MemorySendChannel[None]) -> None:
        """Wake the probe loop on every change watchfiles sees in `weights/`. A watcher
        that cannot start (the inotify watch limit, say) is logged: the timed probes go on
        without it."""
        weights_dir = self.config.weights_dir
        interval_ms = max(1, round(self.config.trainer.poll_interval_s * 1000))
        changes = watchfiles.awatch(
            weights_dir,
            # Any change wakes the probe, which opens exact paths: the default filter
            # (version-control and editor names) would only cost Python per event.
            watch_filter=None,
            debounce=50,
            step=20,
            # The watcher's thread cannot be cancelled: it returns (and the daemon's
            # shutdown waits for it) at its next timeout. Keep that short.
            rust_timeout=min(interval_ms, _WATCHER_WAKE_MS),
        )
        try:
            async with contextlib.aclosing(changes) as events:
                async for _ in events:
                    with contextlib.suppress(trio.WouldBlock):
                        wake.send_nowait(None)
        except OSError as exc:
            log.warning(
                "cannot watch the weights directory; probing it on the timer only",
                weights_dir=str(weights_dir),
                poll_interval_s=self.config.trainer.poll_interval_s,
                error=str(exc) or repr(exc),
            )

    async def check_for_new_version(self) -> None:
        """Apply the newest published version the daemon may use, if it is new.

        The candidates are `applied + 1 .. shipped`: a version is only legitimate once its
        batch has shipped (anything newer is a leftover of another run in the same weights
        directory), so with nothing shipped past the applied version there is nothing to
        look for. Each candidate's `step_N/STABLE` is opened by its exact path, newest
        first, in a worker thread (`newest_published_version`). A probe that fails (a
        network filesystem's error) is logged once and tried again at the next one.
        """
        applied = self.state.versions.applied
        shipped = self.state.shipping.last_shipped
        if shipped <= applied:
            return
        config = self.config
        try:
            version = await trio.to_thread.run_sync(
                functools.partial(
                    newest_published_version,
                    config.weights_dir,
                    above=applied,
                    up_to=shipped,
                    layout=config.trainer.weights_layout,
                ),
                limiter=self.file_limiter,
            )
        except OSError as exc:
            if not self._probe_failing:
                log.warning(
                    "cannot look for new weights; trying again",
                    weights_dir=str(config.weights_dir),
                    error=str(exc) or repr(exc),
                )
            self._probe_failing = True
            return
        if self._probe_failing:
            log.info("looking for new weights works again", weights_dir=str(config.weights_dir))
            self._probe_failing = False
        # The applied version may have moved while the probe ran (start-up's own load).
        if version is not None and version > self.state.versions.applied:
            await self.apply(version)

    async def apply(self, version: int) -> None:
        """Load `version` on every server, apply it, collect, sweep (docs/design.md §5)."""
        previous = self.state.versions.applied
        servers = await self.load(version)
        await self.settle(version)
        bound = self.state.versions.collected_below
        # The servers that loaded it: the console's one line per version names them.
        where = {} if servers is None else {"servers": servers}
        log.info("applied version", version=version, previous=previous, bound=bound, **where)

    async def load(self, version: int) -> list[str] | None:
        """Load `version` on every server and make it the applied version: rollouts
        dispatched from now on are tagged with it. Returns the servers that loaded it
        (None: `[inference] weight_update = "none"` loads nothing)."""
        servers = await broadcast_update_weights(self.client, self.config, self.pool, version)
        self.state.versions.applied = version
        self.state.notify()
        return servers

    async def settle(self, version: int) -> None:
        """The rest of an update to `version`: collect below its bound, then sweep."""
        await self.collect(version)
        await self.sweep()
        versions = self.state.versions
        versions.settled = max(versions.settled, version)
        self.state.notify()

    async def collect(self, version: int) -> None:
        """Delete every `v<k>` below `min_fresh_version(version + 1, m)`."""
        state = self.state
        bound = self.config.staleness.collection_bound(version)
        started = time.monotonic()
        try:
            with trio.fail_after(COLLECT_DEADLINE_S):
                report = await collect_below(self.config.payload_root, bound)
        except (PayloadGCError, trio.TooSlowError, OSError) as exc:
            # Disk use grows until the next collection succeeds; the run itself is safe.
            log.error("collection failed", bound=bound, error=str(exc) or repr(exc))
            return
        # Collections end in the order they start (they share the root's lock), but the
        # start-up one runs beside the watcher's: the bound never goes back.
        versions = state.versions
        versions.collected_below = (
            bound if versions.collected_below is None else max(versions.collected_below, bound)
        )
        # Disk use peaks right before a collection: the running account then (already in
        # `payload.peak_bytes`). The collector looked at no kept version, so the account,
        # not a walk, says what is left: the versions below the bound leave it.
        failed = (parse_version(error.name) for error in report.errors)
        state.payload.record_collected(
            bound,
            files=report.files,
            bytes=report.bytes,
            failed=[v for v in failed if v is not None],
        )
        if report.busy:
            # Not a failure: files deleted while still open elsewhere; the next
            # collection (the directories stay below the bound) tries again.
            log.info(
                "collection left busy directories",
                bound=bound,
                busy=[f"{b.name}: {b.message}" for b in report.busy],
            )
        if self.collection_times is not None:
            self.collection_times.observe_collection(time.monotonic() - started)
        # Once per version, when a step's worth of objects has just been let go.
        await trio.to_thread.run_sync(trim_heap, limiter=self.file_limiter)
        log.info(
            "collected",
            bound=bound,
            dirs=len(report.deleted),
            files=report.files,
            bytes=report.bytes,
            payload_bytes=state.payload.bytes,
            duration_s=round(time.monotonic() - started, 3),
        )
