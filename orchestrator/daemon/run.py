"""The daemon: one trio nursery owned by `run_daemon`, every component started in it.

    local fleet / trainer (optional) ─┐
    start-up sync (docs/design.md §7) ────────┤
    policy watcher ── apply, collect, sweep
    dispatcher ──(GroupResult channel)──> sink: admit, delete discarded files
                                          shipper: assemble, publish, save progress

It ends after `max_steps` batches once the trainer has published the last version and it
has been collected, or when cancelled (SIGINT/SIGTERM in the `run` command).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.environments import make_environment
from orchestrator.core.inflight import InflightLimit
from orchestrator.core.rollouts import GroupResult
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.daemon.dispatcher import Dispatcher
from orchestrator.daemon.http_clients import open_clients
from orchestrator.daemon.metrics import (
    CollectionTimes,
    LoopStats,
    metrics_registry,
    serve_loop_lag_monitor,
    serve_metrics,
)
from orchestrator.daemon.payload_disk import delete_files, measure_tree
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.progress_report import ProgressReporter, Tally, serve_progress_report
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.server_pool import ProbeSettings, ServerPool, serve_health_prober
from orchestrator.daemon.shipping import NothingToShip, ship_step
from orchestrator.daemon.stall import Figures, StallWatch, serve_stall_watch
from orchestrator.daemon.startup import find_start_point, wait_for_version, wipe_payload_root
from orchestrator.daemon.stop import Stop
from orchestrator.handoff import Progress, save_progress

log = structlog.get_logger("orchestrator")


@attrs.frozen
class RunOutcome:
    """What a run did, for the summary: the final state, the sink, and how long it took."""

    state: RunState
    sink: TrainSink
    first_step: int
    duration_s: float
    urls: tuple[str, ...]


@attrs.define
class Daemon:
    """The components of one run and the glue between them."""

    config: Config
    state: RunState
    sink: TrainSink
    file_limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(4))
    # When the last batch shipped, on trio's clock (see orchestrator/daemon/stall.py).
    stall: StallWatch = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: StallWatch(self.config.progress.stall_warning_s, trio.current_time()),
            takes_self=True,
        ),
    )
    # The limit on rollouts in flight (see orchestrator/core/inflight.py).
    inflight: InflightLimit = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: inflight_limit(self.config), takes_self=True),
    )
    # The `progress` line (see orchestrator/daemon/progress_report.py).
    reporter: ProgressReporter = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: ProgressReporter(self.config.progress.report_interval_s),
            takes_self=True,
        ),
    )

    # -- the sink side: admit finished groups, ship batches ------------------------------

    async def serve_admission(
        self,
        results: trio.MemoryReceiveChannel[GroupResult],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Admit every finished group; delete what the sink discards right away."""
        task_status.started()
        async with results:
            async for group in results:
                self._observe_turnaround(group)
                files = self.sink.admit(group, self.state.next_step)
                await self._delete(files, "discard")
                self.state.notify()

    async def serve_shipper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Ship every batch the sink can fill and the gate allows, as soon as it can."""
        task_status.started()
        while True:
            changed = self.state.changed()
            await self.ship_ready()
            await changed.wait()

    async def ship_ready(self) -> None:
        state, sink = self.state, self.sink
        while (
            not state.done_shipping
            and state.may_ship(state.next_step)
            and sink.ready(state.next_step)
        ):
            step = state.next_step
            samples, pruned = sink.assemble(step)
            await self._delete(pruned, "discard")
            try:
                shipment = await ship_step(self.config, step, samples)
            except NothingToShip:
                # Each sample was logged as it was dropped. The step stays next: new
                # samples fill it again (the queue gave these up; their files stay pinned
                # for the collector).
                sink.unship(len(samples))
                log.warning(
                    "batch not shipped: no sample's payload could be read",
                    step=step,
                    dropped=len(samples),
                )
                state.notify()
                continue
            if shipment.dropped:
                sink.unship(len(shipment.dropped))
            state.next_step = step + 1
            self.stall.shipped(trio.current_time(), self.figures())
            self._decide_inflight_limit()
            state.notify()
            await self.save_progress()
            staleness = max(step - 1 - s.start_version for s in samples)
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
                version=state.applied_version,
                samples=shipment.samples,
                groups=len({s.group_id for s in samples}),
                staleness=staleness,
                discards=dict(sink.counters),
                files_deleted=sum(state.files_deleted.values()),
                # The running account (docs/design.md §8): the root is not walked.
                payload_files=state.payload_account.files,
                payload_bytes=state.payload_bytes,
                batch=str(shipment.path),
                **extra,
            )

    def _observe_turnaround(self, group: GroupResult) -> None:
        """What the in-flight limit learns from a group the sink is about to take."""
        if group.dispatched_at is None or group.dispatched_step is None:
            return
        last_step = self.config.staleness.last_step(group.start_version)
        self.inflight.group_admitted(
            trio.current_time() - group.dispatched_at,
            allowance=last_step - group.dispatched_step,
            stale=self.state.next_step > last_step,
        )

    def _decide_inflight_limit(self) -> None:
        decision = self.inflight.shipped(trio.current_time())
        if decision is None:
            return
        self.state.inflight_limit = decision.limit
        self.state.min_allowance = decision.min_allowance
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

    # -- the policy side: sweep after each collection ------------------------------------

    async def sweep(self) -> None:
        """Drop queued groups that can no longer ship, cancel in-flight ones, free files."""
        state, sink = self.state, self.sink
        files = sink.drop_stale(state.next_step)
        for group in list(state.groups.values()):
            if group.start_version < state.fresh_bound:
                group.stop.set()
        if state.bound is not None:
            sink.forget_versions_below(state.bound)
        await self._delete(files, "sweep")
        await self.save_progress()
        state.notify()

    async def save_progress(self) -> None:
        state, sink = self.state, self.sink
        progress = Progress(
            step=state.next_step - 1,
            applied_version=state.applied_version,
            bound=state.bound,
            inflight_rollouts=state.inflight_rollouts,
            inflight_limit=self.inflight.limit,
            queued_samples=sink.queued_samples,
            discards=dict(sink.counters),
            updated_at=time.time(),
            pid=os.getpid(),
            **self._shipping_progress(),
            **self._report_progress(),
        )
        await trio.to_thread.run_sync(
            save_progress, self.config.state_dir, progress, limiter=self.file_limiter
        )

    def _shipping_progress(self) -> dict[str, Any]:
        """The stall watch's part of `progress.json` (wall-clock times)."""
        stall, now, wall = self.stall, trio.current_time(), time.time()
        recent = stall.recent(self.figures())
        shipped_at = stall.shipped_at
        return {
            "started_at": wall - (now - stall.started_at),
            "last_shipped_at": None if shipped_at is None else wall - (now - shipped_at),
            "failures": dict(self.state.failures),
            "recent_discards": dict(recent.discards),
            "recent_failures": dict(recent.failures),
            "top_error": recent.top_error,
        }

    def _report_progress(self) -> dict[str, Any]:
        """The progress line's part of `progress.json` (a wall-clock time)."""
        reporter, at = self.reporter, self.reporter.last_at
        return {
            "needed_samples": self.config.batch.size,
            "last_report": reporter.last,
            "last_report_at": None if at is None else time.time() - (trio.current_time() - at),
        }

    # -- the stall watch and the progress line -------------------------------------------

    def figures(self) -> Figures:
        """What the stall watch reads of the run now."""
        state, sink = self.state, self.sink
        return Figures(
            step=state.next_step,
            queued=sink.queued_samples,
            needed=self.config.batch.size,
            gate_open=state.may_ship(state.next_step),
            applied_version=state.applied_version,
            idle=state.stopping or state.done_shipping,
            discards=sink.counters,
            failures=dict(state.failures),
            texts=state.rejections.texts(),
        )

    async def serve_stall_watch(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Warn while no batch ships (`[progress] stall_warning_s`); save progress with
        each warning, so `orchestrator status` shows the same."""
        await serve_stall_watch(
            self.stall, self.figures, self.save_progress, task_status=task_status
        )

    def tally(self) -> Tally:
        """What the progress line reads of the run now."""
        state = self.state
        return Tally(
            self.figures(),
            state.inflight_rollouts,
            state.rollouts["completed"],
            inflight_limit=self.inflight.limit,
        )

    async def serve_progress_report(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Log `progress` every `[progress] report_interval_s`; save progress with each
        line, so `orchestrator status` shows the same."""
        await serve_progress_report(
            self.reporter, self.tally, self.save_progress, task_status=task_status
        )

    async def _delete(self, files: Sequence[str], path: str) -> None:
        if not files:
            return
        deletion = await delete_files(self.config.payload_root, files, limiter=self.file_limiter)
        self.state.files_deleted[path] += deletion.files
        self.state.bytes_deleted[path] += deletion.bytes
        self.state.record_files_deleted(self.config.payload_root, files, deletion)
        if deletion.problem_count:
            # Left in place: a version directory that became a link or a mount point, or
            # a file that cannot be deleted. The version collector reports them again.
            log.warning(
                "payload files not deleted",
                path=path,
                count=deletion.problem_count,
                problems=list(deletion.problems),
            )

    async def drop_everything_queued(self) -> None:
        """At the end of a run: nothing queued will ever ship, so free its files now."""
        await self._delete(self.sink.drop_all(), "discard")


def inflight_limit(config: Config) -> InflightLimit:
    """The in-flight limit of `config`'s run: adaptive or fixed, below `max_inflight`."""
    return InflightLimit(
        config.inference.inflight_limit,
        ceiling=config.inference.max_inflight,
        group_size=config.batch.group_size,
    )


def sink_limits(config: Config) -> SinkLimits:
    return SinkLimits(
        batch_size=config.batch.size,
        constant_size=config.batch.constant_size,
        staleness=config.staleness,
        curriculum_min_mean_reward=config.env.curriculum_min_mean_reward,
        curriculum_max_mean_reward=config.env.curriculum_max_mean_reward,
        max_seq_len=config.batch.max_seq_len,
    )


def probe_settings(config: Config) -> ProbeSettings:
    return ProbeSettings(
        weights_dir=config.weights_dir,
        weights_layout=config.trainer.weights_layout,
        interval_s=min(1.0, config.inference.unavailable_deadline_s / 3),
        request_timeout_s=min(5.0, config.inference.request_timeout_s),
        unavailable_deadline_s=config.inference.unavailable_deadline_s,
    )


async def start_local_fleet(config: Config, nursery: trio.Nursery) -> list[str]:
    """Start `[sim] inference_servers` local servers (and the local trainer if asked)."""
    urls: list[str] = []
    if config.sim.inference_servers:
        from orchestrator.sim.fleet import sim_inference_config
        from orchestrator.sim.inference import serve_inference

        for index in range(config.sim.inference_servers):
            url = await nursery.start(serve_inference, sim_inference_config(config, index))
            urls.append(str(url))
    if config.sim.trainer:
        from orchestrator.sim.fleet import sim_trainer_config
        from orchestrator.sim.trainer import serve_trainer

        await nursery.start(serve_trainer, sim_trainer_config(config))
    return urls


async def start_metrics(
    listen: str,
    nursery: trio.Nursery,
    state: RunState,
    sink: TrainSink,
    collections: CollectionTimes,
    *,
    sockets: Sequence[socket.socket] = (),
) -> None:
    """The Prometheus endpoint and the event-loop lag monitor that feeds it.

    `collections`: what the policy watcher records collection durations in.
    `sockets`: listening sockets already bound to `listen` (`orchestrator.daemon.preflight`),
    which the endpoint takes over; without them it binds `listen` itself.
    """
    loop_stats = LoopStats()
    # 50 ms: a fine enough view of lag for a scrape every few seconds, at ~0.5% of a core.
    await nursery.start(functools.partial(serve_loop_lag_monitor, loop_stats, interval_s=0.05))
    registry = metrics_registry(state, sink, loop_stats, collections)
    address = await nursery.start(
        functools.partial(serve_metrics, listen, registry, sockets=sockets)
    )
    log.info("metrics endpoint", address=f"{address[0]}:{address[1]}")


#: How long a worker thread may hold the interpreter lock before the event loop's thread
#: can take it (Python's default is 5 ms): the batch writer's planning and the file checks
#: run Python in worker threads, and the loop waited for them.
_SWITCH_INTERVAL_S = 0.001


def _tune_interpreter_for_the_loop() -> float:
    """Hide what start-up allocated (imported modules, the config, the services' and
    clients' structures: about 70,000 objects, all living as long as the daemon) from the
    cycle collector, so a full collection scans only what the run allocates: at real scale
    each full collection over them stopped the event loop for 30-35 ms
    (docs/benchmarks.md); and let worker threads hand the interpreter lock back to the
    loop sooner. Returns the previous switch interval; `run_daemon` undoes both when it
    returns."""
    gc.collect()
    gc.freeze()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    return previous


async def run_daemon(
    config: Config,
    *,
    stop: Stop | None = None,
    metrics_sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[RunState] = trio.TASK_STATUS_IGNORED,
) -> RunOutcome:
    """Run the orchestrator until `max_steps` batches are trained on, or until cancelled.

    Reports its `RunState` through `task_status` once dispatching has started, so a test
    or a status endpoint can watch it. Raises `UserError` for a start-up refusal (a payload
    root the wipe refuses), `InferenceUnavailable` when servers stay away too long.

    `stop` (the `run` command's signals): the caller runs this inside `stop.scope`; a
    request stops the run gracefully once dispatching, at once before (see
    `orchestrator.daemon.stop`). `metrics_sockets`: the metrics listener, bound beforehand.
    """
    started = time.monotonic()
    state = RunState(
        staleness=config.staleness,
        max_steps=config.max_steps,
        routing_shape=config.routing_shape,
    )
    daemon = Daemon(config, state, TrainSink(sink_limits(config)))
    with trio.CancelScope(shield=True):  # a worker thread finishes it anyway
        start = await trio.to_thread.run_sync(
            functools.partial(
                find_start_point,
                config.batches_dir,
                config.state_dir,
                batch_format=config.trainer.format,
                data_world_size=config.trainer.data_world_size,
            )
        )
    if stop is not None:
        stop.watch(state, daemon.sink, first_step=start.resume_step + 1)
        await trio.lowlevel.checkpoint()  # a stop asked for already ends it here, nothing done
    environment = make_environment(
        config.env.name,
        prompt_len_min=config.env.prompt_len_min,
        prompt_len_max=config.env.prompt_len_max,
        vocab_size=config.sim.vocab_size,
        max_turns=config.env.max_turns,
    )
    switch_interval: float | None = None
    if not start.resumed:
        # Before anything starts, so that a refused root stops the run with nothing done.
        log.info("fresh run", payload_root=str(config.payload_root))
        await wipe_payload_root(config.payload_root)
    try:
        # The clients outlive the nursery: no task can find them closed while it is being
        # cancelled.
        async with (
            open_clients(
                config.inference.max_inflight,
                max_reply_bytes=config.max_reply_bytes,
                max_buffered_reply_bytes=config.max_buffered_reply_bytes,
            ) as clients,
            trio.open_nursery() as nursery,
        ):
            urls = [*config.inference.urls, *await start_local_fleet(config, nursery)]
            client = clients.control
            pool = ServerPool.of(urls, on_change=state.notify)
            collections = CollectionTimes() if config.metrics.listen else None
            policy = PolicyWatcher(
                config,
                state,
                client,
                pool,
                daemon.sweep,
                daemon.file_limiter,
                collection_times=collections,
            )
            await nursery.start(
                serve_health_prober,
                pool,
                client,
                probe_settings(config),
                state,
            )
            if start.resumed:
                log.info("resuming", last_shipped=start.resume_step)
                state.next_step = start.resume_step + 1
                await wait_for_version(
                    config.weights_dir,
                    start.resume_step,
                    poll_interval_s=config.trainer.poll_interval_s,
                    layout=config.trainer.weights_layout,
                )
                if start.resume_step > 0:
                    await policy.load(start.resume_step)
            await daemon.save_progress()
            send, receive = trio.open_memory_channel[GroupResult](16)
            dispatcher = Dispatcher(
                config,
                state,
                environment,
                clients.generate,
                send,
                daemon.sink,
                daemon.file_limiter,
                pool,
            )
            if collections is not None:
                await start_metrics(
                    config.metrics.listen,
                    nursery,
                    state,
                    daemon.sink,
                    collections,
                    sockets=metrics_sockets,
                )
            await nursery.start(policy.serve)
            await nursery.start(daemon.serve_admission, receive)
            await nursery.start(daemon.serve_shipper)
            daemon.inflight.started(trio.current_time())
            state.inflight_limit = daemon.inflight.limit
            await nursery.start(dispatcher.serve)
            await nursery.start(daemon.serve_stall_watch)
            await nursery.start(daemon.serve_progress_report)
            if start.resumed and start.resume_step > 0:
                # The start-up collection (docs/design.md §7) runs like any policy update's, beside
                # the rollouts of the applied version: over a root of a million files it
                # takes minutes that the servers would otherwise sit idle.
                nursery.start_soon(_settle_resumed, policy, start.resume_step)
            switch_interval = _tune_interpreter_for_the_loop()
            task_status.started(state)
            if stop is not None:
                _stop_gracefully_when_asked(stop, state, nursery)
            if config.max_steps:
                await _wait_until_trained(state, config.max_steps)
                await _drain_groups(state, config.inference.request_timeout_s)
                # Stale groups stopped since the last collection wrote into versions
                # below the bound until their last request returned: collect again.
                await policy.collect(state.applied_version)
                await daemon.drop_everything_queued()
                nursery.cancel_scope.cancel()
            else:
                await trio.sleep_forever()
    finally:
        gc.unfreeze()
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)
        # Stopped by a signal or an error too: save what is known, within the grace time.
        with trio.move_on_after(config.shutdown.grace_s) as cleanup:
            cleanup.shield = True
            await daemon.save_progress()

    _, on_disk = await measure_tree(config.payload_root, limiter=daemon.file_limiter)
    state.record_payload_bytes(on_disk)
    return RunOutcome(
        state, daemon.sink, start.resume_step + 1, time.monotonic() - started, tuple(urls)
    )


async def _settle_resumed(policy: PolicyWatcher, version: int) -> None:
    await policy.settle(version)
    log.info("resumed", version=version, bound=policy.state.bound)


def _stop_gracefully_when_asked(stop: Stop, state: RunState, nursery: trio.Nursery) -> None:
    """From now on a stop request lets the groups in flight end after their requests
    (within the grace time, or until a second request), then stops the run."""

    async def stop_when_asked() -> None:
        await stop.requested.wait()
        with stop.grace():
            await _drain_groups(state, math.inf)
        stop.scope.cancel()

    stop.graceful = True
    nursery.start_soon(stop_when_asked)


async def _wait_until_trained(state: RunState, max_steps: int) -> None:
    """Until the trainer has published (and the daemon applied and collected) `max_steps`."""
    while not (state.done_shipping and state.settled_version >= max_steps):
        await state.wait_changed()
    log.info("all batches trained on", steps=max_steps, version=state.applied_version)


async def _drain_groups(state: RunState, deadline_s: float) -> None:
    """Nothing more can ship: stop every group after its requests in flight return (so
    their payload files are all written), cancelling what is still running at the deadline."""
    state.stopping = True
    for group in list(state.groups.values()):
        group.stop.set()
    with trio.move_on_after(deadline_s):
        while state.groups:
            await state.wait_changed()
    for group in list(state.groups.values()):
        group.cancel_scope.cancel()
