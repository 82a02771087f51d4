"""`run_daemon`: one trio nursery, the services of a run started in it, in order (built
together by `services.open_services`).

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
from orchestrator.daemon.ending import (
    account_for_a_stopped_run,
    drain_groups,
    stop_gracefully_when_asked,
    wait_until_trained,
)
from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.server_pool import serve_health_prober
from orchestrator.daemon.interpreter import tune_interpreter_for_the_loop, untune_interpreter
from orchestrator.daemon.metrics import start_metrics
from orchestrator.daemon.pass_budget import keep_passes_short
from orchestrator.daemon.payload_files.disk import measure_tree
from orchestrator.daemon.reporting.no_progress import serve_progress_watch
from orchestrator.daemon.reporting.progress_report import serve_progress_report
from orchestrator.daemon.reporting.stall import serve_stall_watch
from orchestrator.daemon.reporting.wandb_log import open_wandb_log
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.services import FILE_THREADS, RunInputs, Services, open_services
from orchestrator.daemon.settings import probe_settings, sink_limits
from orchestrator.daemon.startup import (
    StartPoint,
    check_moe_reload,
    find_start_point,
    wait_for_version,
    wipe_payload_root,
)
from orchestrator.daemon.stop import Stop
from orchestrator.handoff import HandoffFormat, load_progress

log = structlog.get_logger(__name__)


@attrs.frozen
class RunOutcome:
    """What a run did, for the summary: the final state, the sink, where it started, how
    long it took, the servers, whether a stop request ended it, and the CPU seconds the
    process spent meanwhile (`time.process_time`: every thread of the process, so the
    local fleet and trainer too when they run in it)."""

    state: RunState
    sink: TrainSink
    first_step: int
    duration_s: float
    urls: tuple[str, ...]
    stopped: bool = False
    cpu_s: float = 0.0


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
    """Run the orchestrator until `max_steps` batches are trained on, until `stop` is
    requested, or until cancelled; its `RunState` goes to `task_status` once dispatching
    has started, so a test or a status endpoint can watch it. Raises `UserError` for a
    start-up refusal (a payload root the wipe refuses; a mixture-of-experts model with
    `weight_update = "vllm"` against a vLLM that does not reload its experts,
    `check_moe_reload`), `InferenceUnavailable` when servers stay away too long.

    `stop` (the `run` command's signals): a request stops the run gracefully once
    dispatching, at once before (see `orchestrator.daemon.stop`); the outcome says so.
    A fleet that refuses every request with the same client error for
    `inference.refusal_stop_s` stops the run the same way (`orchestrator.core.refusals`),
    and so does a run where rollouts keep finishing and none is trainable for
    `progress.no_progress_stop_s` (`reporting/no_progress.py`): the outcome is stopped
    and `state.dispatch.halt_reason` says why.
    The other arguments are what the run runs against: see `services.RunInputs`.
    """
    started, cpu_started = time.monotonic(), time.process_time()
    inputs = RunInputs(
        tuple(servers), environment, handoff, tuple(evals), token, tuple(metrics_sockets)
    )
    state = RunState.new(
        config.staleness, max_steps=config.max_steps, routing_shape=config.routing_shape
    )
    sink = TrainSink(sink_limits(config))
    # A run ends gracefully on its own too (a fleet that refuses every request): with a
    # stop of its own when the caller gave none.
    stop = Stop(grace_s=config.shutdown.grace_s) if stop is None else stop
    start = StartPoint(0, resumed=False)
    async with open_wandb_log(config) as wandb:
        with stop.scope, keep_passes_short():
            start = await _prepare(config, inputs, state)
            resumed = start.resumed
            async with open_services(config, inputs, state, sink, resumed=resumed) as services:
                services.lines.mirror_to(wandb)
                await _serve(services, start, stop, task_status)
    stopped = stop.scope.cancelled_caught
    await _account_for_the_end(config, handoff, state, stop if stopped else None)
    duration_s = time.monotonic() - started
    cpu_s = time.process_time() - cpu_started
    return RunOutcome(
        state, sink, start.resume_step + 1, duration_s, inputs.servers, stopped, cpu_s
    )


async def _account_for_the_end(
    config: Config, handoff: HandoffFormat, state: RunState, stop: Stop | None
) -> None:
    """A run `stop` ended: what it left (`ending.account_for_a_stopped_run`); a finished
    one: the bytes left on disk, measured."""
    if stop is not None:
        await account_for_a_stopped_run(config, handoff, state, stop)
        return
    limiter = trio.CapacityLimiter(FILE_THREADS)
    _, on_disk = await measure_tree(config.payload_root, limiter=limiter)
    state.payload.record_measured(on_disk)


async def _prepare(config: Config, inputs: RunInputs, state: RunState) -> StartPoint:
    """Before any service starts: refuse a run the servers would silently get wrong, find
    where the run starts, and wipe a fresh run's payload root (a refused root stops the run
    with nothing done)."""
    await check_moe_reload(config, inputs.servers, inputs.token)
    with trio.CancelScope(shield=True):  # a worker thread finishes it anyway
        start = await trio.to_thread.run_sync(_find_start, config, inputs.handoff, state)
    await trio.lowlevel.checkpoint()  # a stop asked for already: nothing done
    if not start.resumed:
        log.info("fresh run", payload_root=str(config.payload_root))
        await wipe_payload_root(config.payload_root)
    return start


def _find_start(config: Config, handoff: HandoffFormat, state: RunState) -> StartPoint:
    """Where the run starts, and (resuming) the prompts the last run drew. Blocking."""
    start = find_start_point(handoff, config.handoff_settings, config.state_dir)
    if start.resumed:
        progress = load_progress(config.state_dir)
        state.dispatch.prompts_drawn = 0 if progress is None else progress.prompts_drawn
    return start


async def _serve(
    services: Services, start: StartPoint, stop: Stop, task_status: trio.TaskStatus[RunState]
) -> None:
    """Start every service in order, run until the last batch is trained on (or forever
    without `max_steps`), then cancel them all; save progress however it ends."""
    config, state = services.config, services.state
    switch_interval: float | None = None
    try:
        async with trio.open_nursery() as nursery:
            await _start_services(services, start, nursery)
            switch_interval = tune_interpreter_for_the_loop()
            task_status.started(state)
            stop_gracefully_when_asked(stop, state, nursery)
            nursery.start_soon(_stop_when_halted, state, stop)
            await _run_to_the_end(services)
            nursery.cancel_scope.cancel()
    finally:
        untune_interpreter(switch_interval)
        # Stopped by a signal or an error too: save what is known, within the grace time.
        with trio.move_on_after(config.shutdown.grace_s) as cleanup:
            cleanup.shield = True
            await services.progress.save()


async def _start_services(services: Services, start: StartPoint, nursery: trio.Nursery) -> None:
    """The services, started in order: the prober first (a resumed run loads its version
    on the servers it finds up), the dispatcher after everything that takes its groups."""
    config, state, figures = services.config, services.state, services.figures
    await nursery.start(
        serve_health_prober, services.pool, services.control, probe_settings(config), state
    )
    if start.resumed:
        await _resume(services, start.resume_step)
    await services.progress.save()
    services.desk.attach(nursery)
    if services.collection_times is not None:
        await start_metrics(
            config.metrics.listen,
            nursery,
            state,
            services.sink,
            services.collection_times,
            sockets=services.inputs.metrics_sockets,
        )
    await nursery.start(services.policy.serve)
    await nursery.start(services.shipper.serve)
    services.admission.start()
    if services.evaluator is not None:
        await nursery.start(services.evaluator.serve)
    await nursery.start(services.dispatcher.serve)
    await nursery.start(serve_stall_watch, figures.stall, figures.snapshot, services.progress.save)
    await nursery.start(serve_progress_watch, figures.watch, figures.snapshot, state)
    await nursery.start(
        functools.partial(serve_progress_report, started_at=figures.stall.started_at),
        figures.reporter,
        figures.snapshot,
        services.progress.save,
    )
    if start.resumed and start.resume_step > 0:
        # The start-up collection (docs/design.md §7) runs like any policy update's,
        # beside the rollouts of the applied version: over a root of a million files it
        # takes minutes that the servers would otherwise sit idle.
        nursery.start_soon(_settle_resumed, services, start.resume_step)


async def _run_to_the_end(services: Services) -> None:
    """Until `max_steps` batches are trained on, the groups drained, the last eval done
    and the last collection made; forever without `max_steps`."""
    config, state = services.config, services.state
    if not config.max_steps:
        await trio.sleep_forever()
    await wait_until_trained(state, config.max_steps)
    await drain_groups(state, config.inference.request_timeout_s)
    if services.evaluator is not None:
        # The last version's eval, with the whole fleet now.
        await services.evaluator.wait_caught_up(config.max_steps)
    # Stale groups stopped since the last collection wrote into versions below the bound
    # until their last request returned: collect again.
    await services.policy.collect(state.versions.applied)
    await services.sweeper.drop_everything_queued()


async def _stop_when_halted(state: RunState, stop: Stop) -> None:
    """Stop the run gracefully once it halts itself (`Dispatch.halt`: the whole fleet
    refuses every request, or nothing trainable comes any more): what was shipped stays
    shipped, and the run can be resumed once what stopped it is mended."""
    dispatch = state.dispatch
    await dispatch.halted.wait()
    assert dispatch.halt_reason is not None
    stop.request(dispatch.halt_reason.by)


async def _resume(services: Services, step: int) -> None:
    """Go on after batch `step`: wait for the trainer to publish `v{step}`, then load it."""
    config, state = services.config, services.state
    log.info("resuming", last_shipped=step, prompts_drawn=state.dispatch.prompts_drawn)
    state.shipping.next_step = step + 1
    await wait_for_version(
        config.weights_dir,
        step,
        poll_interval_s=config.trainer.poll_interval_s,
        layout=config.trainer.weights_layout,
    )
    if step > 0:
        await services.policy.load(step)


async def _settle_resumed(services: Services, version: int) -> None:
    await services.policy.settle(version)
    log.info("resumed", version=version, bound=services.state.versions.collected_below)
