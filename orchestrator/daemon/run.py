"""`run_daemon`: one trio nursery, the services of a run started in it.

    start-up sync (docs/design.md §7)
    health prober ─── servers down and back
    policy watcher ── apply, collect, sweep
    dispatcher ──(each group's task)──> admission: into the sink, delete discarded files
                                        shipper: assemble, publish, save progress
    evaluator ─────── evals beside training, within their share of the in-flight limit
    stall watch, progress line, metrics endpoint

The daemon is given what it runs against: the inference servers' URLs, the environment its
prompts and rewards come from, and the hand-off format it ships in (`orchestrator run`
starts the simulator's fleet beside it when the config asks). It ends after `max_steps`
batches once the trainer has published the last version and it has been collected, or
when stopped (`orchestrator.daemon.stop`), and returns what the run did either way.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Sequence

import attrs
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.environments import Environment
from orchestrator.core.evals import EvalTask
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.admission import Admission
from orchestrator.daemon.dispatcher import Dispatcher
from orchestrator.daemon.ending import (
    account_for_a_stopped_run,
    drain_groups,
    stop_gracefully_when_asked,
    wait_until_trained,
)
from orchestrator.daemon.evaluation import Evaluator
from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.http_clients import open_clients
from orchestrator.daemon.inference.server_pool import ServerPool, serve_health_prober
from orchestrator.daemon.interpreter import tune_interpreter_for_the_loop, untune_interpreter
from orchestrator.daemon.metrics import CollectionTimes, start_metrics
from orchestrator.daemon.pass_budget import keep_passes_short
from orchestrator.daemon.payload_files.disk import PayloadDeleter, measure_tree
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.reporting.progress_file import ProgressFile, RunFigures
from orchestrator.daemon.reporting.progress_report import ProgressReporter, serve_progress_report
from orchestrator.daemon.reporting.run_lines import RunLines
from orchestrator.daemon.reporting.stall import StallWatch, serve_stall_watch
from orchestrator.daemon.reporting.wandb_log import open_wandb_log
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.settings import inflight_limit, probe_settings, sink_limits
from orchestrator.daemon.shipper import Shipper
from orchestrator.daemon.startup import (
    StartPoint,
    check_moe_reload,
    find_start_point,
    wait_for_version,
    wipe_payload_root,
)
from orchestrator.daemon.stop import Stop
from orchestrator.daemon.sweep import Sweeper
from orchestrator.handoff import HandoffFormat, load_progress

log = structlog.get_logger(__name__)


@attrs.frozen
class RunOutcome:
    """What a run did, for the summary: the final state, the sink, where it started, how
    long it took, the servers, and whether a stop request ended it."""

    state: RunState
    sink: TrainSink
    first_step: int
    duration_s: float
    urls: tuple[str, ...]
    stopped: bool = False


@attrs.frozen
class Services:
    """The run's services that share its state, built before any of them starts."""

    config: Config
    state: RunState
    sink: TrainSink
    file_limiter: trio.CapacityLimiter
    figures: RunFigures
    progress: ProgressFile
    admission: Admission
    sweeper: Sweeper
    shipper: Shipper
    lines: RunLines

    @classmethod
    def build(
        cls, config: Config, handoff: HandoffFormat, state: RunState, sink: TrainSink
    ) -> Services:
        limiter = trio.CapacityLimiter(4)
        lines = RunLines(config.steps_file, config.evals_file, limiter)
        deleter = PayloadDeleter(config.payload_root, state.payload, limiter)
        figures = RunFigures(
            state,
            sink,
            StallWatch(config.progress.stall_warning_s, trio.current_time()),
            ProgressReporter(config.progress.report_interval_s),
            config.batch.size,
            config.inference.max_inflight,
        )
        progress = ProgressFile(config.state_dir, figures, limiter)
        admission = Admission(state, sink, deleter, inflight_limit(config))
        sweeper = Sweeper(state, sink, deleter, progress)
        shipper = Shipper(
            config, handoff, state, sink, deleter, admission, figures, progress, lines
        )
        return cls(
            config, state, sink, limiter, figures, progress, admission, sweeper, shipper, lines
        )


async def run_daemon(
    config: Config,
    *,
    servers: Sequence[str],
    environment: Environment,
    handoff: HandoffFormat,
    evals: Sequence[EvalTask] = (),
    token: BearerToken | None = None,
    stop: Stop | None = None,
    metrics_sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[RunState] = trio.TASK_STATUS_IGNORED,
) -> RunOutcome:
    """Run the orchestrator against `servers` on `environment`'s prompts, shipping in the
    `handoff` format, until `max_steps` batches are trained on, until `stop` is requested,
    or until cancelled.

    Reports its `RunState` through `task_status` once dispatching has started, so a test
    or a status endpoint can watch it. Raises `UserError` for a start-up refusal (a payload
    root the wipe refuses; a mixture-of-experts model with `weight_update = "vllm"`
    against a vLLM that does not reload its experts, `check_moe_reload`),
    `InferenceUnavailable` when servers stay away too long.

    `stop` (the `run` command's signals): a request stops the run gracefully once
    dispatching, at once before (see `orchestrator.daemon.stop`); the outcome says so.
    A fleet that refuses every request with the same client error for
    `inference.refusal_stop_s` stops the run the same way (`orchestrator.core.refusals`):
    the outcome is stopped and `state.dispatch.refused` says why.
    `metrics_sockets`: the metrics listener, bound beforehand. `token`: the servers'
    bearer token (`orchestrator.daemon.inference.credentials`), sent with every request.
    `evals`: the tasks of `[[eval.env]]`, evaluated when `[eval]` says (none: no evals).
    """
    started = time.monotonic()
    state = RunState.new(
        config.staleness, max_steps=config.max_steps, routing_shape=config.routing_shape
    )
    services = Services.build(config, handoff, state, TrainSink(sink_limits(config)))
    # A run ends gracefully on its own too (a fleet that refuses every request): with a
    # stop of its own when the caller gave none.
    stop = Stop(grace_s=config.shutdown.grace_s) if stop is None else stop
    scope = stop.scope
    start = StartPoint(0, resumed=False)
    async with open_wandb_log(config) as wandb:
        services.lines.mirror_to(wandb)
        with scope, keep_passes_short():
            # Before anything changes: a run the servers would silently get wrong.
            await check_moe_reload(config, servers, token)
            with trio.CancelScope(shield=True):  # a worker thread finishes it anyway
                start = await trio.to_thread.run_sync(_find_start, config, handoff, state)
            await trio.lowlevel.checkpoint()  # a stop asked for already: nothing done
            await _serve(
                services,
                start,
                servers,
                environment,
                evals,
                token,
                stop,
                metrics_sockets,
                task_status,
            )
    stopped = scope.cancelled_caught
    if stopped:
        await account_for_a_stopped_run(config, handoff, state, stop)
    else:
        _, on_disk = await measure_tree(config.payload_root, limiter=services.file_limiter)
        state.payload.record_measured(on_disk)
    return RunOutcome(
        state,
        services.sink,
        start.resume_step + 1,
        time.monotonic() - started,
        tuple(servers),
        stopped=stopped,
    )


def _find_start(config: Config, handoff: HandoffFormat, state: RunState) -> StartPoint:
    """Where the run starts, and (resuming) the prompts the last run drew. Blocking."""
    start = find_start_point(handoff, config.handoff_settings, config.state_dir)
    if start.resumed:
        progress = load_progress(config.state_dir)
        state.dispatch.prompts_drawn = 0 if progress is None else progress.prompts_drawn
    return start


async def _serve(
    services: Services,
    start: StartPoint,
    servers: Sequence[str],
    environment: Environment,
    evals: Sequence[EvalTask],
    token: BearerToken | None,
    stop: Stop,
    metrics_sockets: Sequence[socket.socket],
    task_status: trio.TaskStatus[RunState],
) -> None:
    config, state, sink = services.config, services.state, services.sink
    if not start.resumed:
        # Before anything starts, so that a refused root stops the run with nothing done.
        log.info("fresh run", payload_root=str(config.payload_root))
        await wipe_payload_root(config.payload_root)
    switch_interval: float | None = None
    try:
        # The clients outlive the nursery: no task can find them closed while it is being
        # cancelled.
        async with (
            open_clients(
                config.inference.max_inflight,
                max_reply_bytes=config.max_reply_bytes,
                max_buffered_reply_bytes=config.max_buffered_reply_bytes,
                token=token,
            ) as clients,
            trio.open_nursery() as nursery,
        ):
            pool = ServerPool.of(servers, on_change=state.notify)
            collections = CollectionTimes() if config.metrics.listen else None
            policy = PolicyWatcher(
                config,
                state,
                clients.control,
                pool,
                services.sweeper.sweep,
                services.file_limiter,
                collection_times=collections,
            )
            await nursery.start(
                serve_health_prober, pool, clients.control, probe_settings(config), state
            )
            if start.resumed:
                await _resume(config, state, policy, start.resume_step)
            await services.progress.save()
            dispatcher = Dispatcher(
                config,
                state,
                environment,
                clients.generate,
                services.admission.admit,
                sink,
                services.file_limiter,
                pool,
            )
            if collections is not None:
                await start_metrics(
                    config.metrics.listen,
                    nursery,
                    state,
                    sink,
                    collections,
                    sockets=metrics_sockets,
                )
            await nursery.start(policy.serve)
            await nursery.start(services.shipper.serve)
            services.admission.start()
            evaluator = None
            if evals:
                evaluator = Evaluator(
                    config,
                    state,
                    evals,
                    clients.generate,
                    pool,
                    services.lines,
                    resumed=start.resumed,
                )
                await nursery.start(evaluator.serve)
            await nursery.start(dispatcher.serve)
            figures = services.figures
            await nursery.start(
                serve_stall_watch, figures.stall, figures.snapshot, services.progress.save
            )
            await nursery.start(
                functools.partial(serve_progress_report, started_at=figures.stall.started_at),
                figures.reporter,
                figures.snapshot,
                services.progress.save,
            )
            if start.resumed and start.resume_step > 0:
                # The start-up collection (docs/design.md §7) runs like any policy
                # update's, beside the rollouts of the applied version: over a root of a
                # million files it takes minutes that the servers would otherwise sit idle.
                nursery.start_soon(_settle_resumed, policy, start.resume_step)
            switch_interval = tune_interpreter_for_the_loop()
            task_status.started(state)
            stop_gracefully_when_asked(stop, state, nursery)
            nursery.start_soon(_stop_when_refused, state, stop)
            if config.max_steps:
                await wait_until_trained(state, config.max_steps)
                await drain_groups(state, config.inference.request_timeout_s)
                if evaluator is not None:
                    # The last version's eval, with the whole fleet now.
                    await evaluator.wait_caught_up(config.max_steps)
                # Stale groups stopped since the last collection wrote into versions
                # below the bound until their last request returned: collect again.
                await policy.collect(state.versions.applied)
                await services.sweeper.drop_everything_queued()
                nursery.cancel_scope.cancel()
            else:
                await trio.sleep_forever()
    finally:
        untune_interpreter(switch_interval)
        # Stopped by a signal or an error too: save what is known, within the grace time.
        with trio.move_on_after(config.shutdown.grace_s) as cleanup:
            cleanup.shield = True
            await services.progress.save()


async def _stop_when_refused(state: RunState, stop: Stop) -> None:
    """Stop the run gracefully once the whole fleet refuses every request (what was
    shipped stays shipped; the run can be resumed once the servers are mended)."""
    await state.dispatch.refusal.wait()
    stop.request("refused")


async def _resume(config: Config, state: RunState, policy: PolicyWatcher, step: int) -> None:
    """Go on after batch `step`: wait for the trainer to publish `v{step}`, then load it."""
    log.info("resuming", last_shipped=step, prompts_drawn=state.dispatch.prompts_drawn)
    state.shipping.next_step = step + 1
    await wait_for_version(
        config.weights_dir,
        step,
        poll_interval_s=config.trainer.poll_interval_s,
        layout=config.trainer.weights_layout,
    )
    if step > 0:
        await policy.load(step)


async def _settle_resumed(policy: PolicyWatcher, version: int) -> None:
    await policy.settle(version)
    log.info("resumed", version=version, bound=policy.state.versions.collected_below)
