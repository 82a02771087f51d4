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
import httpx
import structlog
import trio
import watchfiles
from payload_gc import PayloadGCError, collect_below

from orchestrator.config import Config
from orchestrator.daemon.heap import trim_heap
from orchestrator.daemon.inference_client import post_update_weights
from orchestrator.daemon.metrics import CollectionTimes
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.server_pool import ServerPool
from orchestrator.handoff import published_versions, weights_step_dir
from orchestrator.wire import InferenceFailure

log = structlog.get_logger("orchestrator.policy")


#: The longest one collection may take before the run stops with an error.
COLLECT_DEADLINE_S = 3600.0


async def broadcast_update_weights(
    client: httpx.AsyncClient, config: Config, pool: ServerPool, version: int
) -> None:
    """Tell every healthy server to load `version`, concurrently, with retries.

    A server that still fails after `retries` attempts is marked down: it gets the
    version from the health prober when it comes back, and no group is pinned to it
    meanwhile. Never raises for a failing server (the prober's deadline decides when
    having no server at all is fatal).
    """
    weight_dir = weights_step_dir(config.weights_dir, version, layout=config.trainer.weights_layout)

    async def update(url: str) -> None:
        for attempt in range(config.inference.retries + 1):
            try:
                with trio.fail_after(config.inference.request_timeout_s):
                    await post_update_weights(client, url, weight_dir)
                return
            except (InferenceFailure, trio.TooSlowError) as exc:
                error = str(exc) or "no answer in time"
                log.warning("update_weights failed", url=url, version=version, error=error)
            await trio.sleep(min(config.inference.retry_backoff_s * 2**attempt, 10.0))
        pool.mark_down(url, f"did not load v{version}")

    async with trio.open_nursery() as nursery:
        for url in pool.healthy():
            nursery.start_soon(update, url)


@attrs.define
class PolicyWatcher:
    """Applies new policy versions as the trainer publishes them; see `serve`."""

    config: Config
    state: RunState
    client: httpx.AsyncClient
    pool: ServerPool
    # Called after each collection: sweeps the sink and cancels groups that cannot ship.
    sweep: Callable[[], Awaitable[None]]
    file_limiter: trio.CapacityLimiter
    # Given when metrics are on: receives each collection's duration.
    collection_times: CollectionTimes | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch `weights/` until cancelled; apply each new version in order of arrival."""
        config = self.config
        await trio.to_thread.run_sync(lambda: config.weights_dir.mkdir(parents=True, exist_ok=True))
        task_status.started()
        timeout_ms = max(int(config.trainer.poll_interval_s * 1000), 50)
        watch = watchfiles.awatch(
            config.weights_dir,
            force_polling=config.trainer.force_polling,
            poll_delay_ms=timeout_ms,
            debounce=50,
            step=20,
            # Wake up regularly even without events: a re-scan catches anything a watcher
            # missed, and cancellation never waits long on the watcher's thread.
            rust_timeout=timeout_ms,
            yield_on_timeout=True,
        )
        await self.check_for_new_version()
        async with contextlib.aclosing(watch) as changes:
            async for _ in changes:
                await self.check_for_new_version()

    async def check_for_new_version(self) -> None:
        above = self.state.applied_version
        config = self.config
        versions = await trio.to_thread.run_sync(
            functools.partial(
                published_versions,
                config.weights_dir,
                above=above,
                layout=config.trainer.weights_layout,
            ),
            limiter=self.file_limiter,
        )
        # A version is only legitimate once its batch has shipped: anything newer is a
        # leftover of another run in the same weights directory.
        shipped = self.state.next_step - 1
        usable = [v for v in versions if v <= shipped]
        if usable and usable[-1] > self.state.applied_version:
            await self.apply(usable[-1])

    async def apply(self, version: int) -> None:
        """Load `version` on every server, apply it, collect, sweep (docs/design.md §5)."""
        previous = self.state.applied_version
        await self.load(version)
        await self.settle(version)
        log.info("applied version", version=version, previous=previous, bound=self.state.bound)

    async def load(self, version: int) -> None:
        """Load `version` on every server and make it the applied version: rollouts
        dispatched from now on are tagged with it."""
        await broadcast_update_weights(self.client, self.config, self.pool, version)
        self.state.applied_version = version
        self.state.notify()

    async def settle(self, version: int) -> None:
        """The rest of an update to `version`: collect below its bound, then sweep."""
        await self.collect(version)
        await self.sweep()
        self.state.settled_version = max(self.state.settled_version, version)
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
        state.bound = bound if state.bound is None else max(state.bound, bound)
        # Disk use peaks right before a collection. The collector measured every version
        # directory anyway: what it deleted plus what it kept is the peak, at no cost.
        before = report.bytes + sum(k.usage.bytes for k in report.kept if k.usage is not None)
        state.record_payload_bytes(before)
        state.payload_bytes = before - report.bytes
        if self.collection_times is not None:
            self.collection_times.observe_collection(time.monotonic() - started)
        state.files_deleted["collection"] += report.files
        state.bytes_deleted["collection"] += report.bytes
        # Once per version, when a step's worth of objects has just been let go.
        await trio.to_thread.run_sync(trim_heap, limiter=self.file_limiter)
        log.info(
            "collected",
            bound=bound,
            dirs=len(report.deleted),
            files=report.files,
            bytes=report.bytes,
            duration_s=round(time.monotonic() - started, 3),
        )
