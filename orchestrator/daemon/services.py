"""Every service of a run, built in one place: `open_services` opens the HTTP clients and
builds the services on them, none started; `run.py` starts them in order.

How a service is configured (docs/design.md §2): a service, what `run_daemon` starts,
takes the run's frozen `Config` whole, first, and its collaborators after it, as
hypercorn's `serve(app, config)` does: sharing a frozen config costs nothing, and a new
setting touches its section and the one service that reads it. What a service is built
from takes narrow values instead (the core's pure objects, the prober's `ProbeSettings`,
the reporting parts): those are read off the config once, in `settings.py` or here, so
they can be built and tested without a config, and the core never learns its layout.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from orchestrator.config import Config
from orchestrator.core.environments import Environment
from orchestrator.core.evals import EvalTask
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.admission import Admission
from orchestrator.daemon.dispatcher import Dispatcher
from orchestrator.daemon.evaluation import Evaluator
from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.http_clients import Clients, open_clients
from orchestrator.daemon.inference.model_endpoint import ModelDesk
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.metrics import CollectionTimes
from orchestrator.daemon.payload_files.disk import PayloadDeleter
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.daemon.reporting.no_progress import MIN_BATCHES, ProgressWatch, RewardRange
from orchestrator.daemon.reporting.progress_file import ProgressFile, RunFigures
from orchestrator.daemon.reporting.progress_report import ProgressReporter
from orchestrator.daemon.reporting.run_lines import RunLines
from orchestrator.daemon.reporting.stall import StallWatch
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.settings import inflight_limit
from orchestrator.daemon.shipper import Shipper
from orchestrator.daemon.sweep import Sweeper
from orchestrator.handoff import HandoffFormat

#: Worker threads for file work at once (checks, deletes, progress, run lines).
FILE_THREADS = 4


@attrs.frozen
class RunInputs:
    """What a run runs against (the arguments of `run_daemon`): the servers' URLs and
    their bearer token (`inference.credentials`, sent with every request), the environment
    its prompts and rewards come from, the hand-off format it ships in, the tasks of
    `[[eval.env]]` (evaluated when `[eval]` says; none: no evals), and the metrics
    listener, bound beforehand (`preflight`)."""

    servers: tuple[str, ...]
    environment: Environment
    handoff: HandoffFormat
    evals: tuple[EvalTask, ...] = ()
    token: BearerToken | None = None
    metrics_sockets: tuple[socket.socket, ...] = ()


@attrs.frozen
class Services:
    """The run's services and what they share, built before any of them starts."""

    config: Config
    inputs: RunInputs
    state: RunState
    sink: TrainSink
    file_limiter: trio.CapacityLimiter
    control: HTTP11Client
    pool: ServerPool
    lines: RunLines
    figures: RunFigures
    progress: ProgressFile
    admission: Admission
    sweeper: Sweeper
    shipper: Shipper
    policy: PolicyWatcher
    dispatcher: Dispatcher
    evaluator: Evaluator | None
    # Given when metrics are on: the policy watcher records each collection's duration.
    collection_times: CollectionTimes | None
    # Where environments that drive their own turns call the model (served on first use).
    desk: ModelDesk


@asynccontextmanager
async def open_services(
    config: Config, inputs: RunInputs, state: RunState, sink: TrainSink, *, resumed: bool
) -> AsyncIterator[Services]:
    """The run's HTTP clients, open for as long as the block runs (they outlive the
    nursery the services run in, so no task finds them closed while it is cancelled), and
    every service built on them. `resumed`: the run goes on from an earlier one."""
    async with open_clients(
        config.inference.max_inflight,
        max_reply_bytes=config.max_reply_bytes,
        max_buffered_reply_bytes=config.max_buffered_reply_bytes,
        token=inputs.token,
    ) as clients:
        yield build_services(config, inputs, state, sink, clients, resumed=resumed)


def build_services(
    config: Config,
    inputs: RunInputs,
    state: RunState,
    sink: TrainSink,
    clients: Clients,
    *,
    resumed: bool,
) -> Services:
    """Every service of the run, wired to the others (see `open_services`)."""
    limiter = trio.CapacityLimiter(FILE_THREADS)
    lines = RunLines(config.steps_file, config.evals_file, limiter)
    deleter = PayloadDeleter(config.payload_root, state.payload, limiter)
    figures = _figures(config, state, sink)
    progress = ProgressFile(config.state_dir, figures, limiter)
    admission = Admission(state, sink, deleter, inflight_limit(config))
    sweeper = Sweeper(state, sink, deleter, progress)
    shipper = Shipper(
        config, inputs.handoff, state, sink, deleter, admission, figures, progress, lines
    )
    pool = ServerPool.of(inputs.servers, on_change=state.notify)
    times = CollectionTimes() if config.metrics.listen else None
    policy = PolicyWatcher(config, state, clients.control, pool, sweeper.sweep, limiter, times)
    desk = ModelDesk(config.inference.model, config.batch.max_seq_len)
    env, generate, admit = inputs.environment, clients.generate, admission.admit
    dispatcher = Dispatcher(config, state, env, generate, admit, sink, limiter, pool, desk)
    evaluator = None
    if inputs.evals:
        evaluator = Evaluator(config, state, inputs.evals, generate, pool, lines, resumed, desk)
    return Services(
        config,
        inputs,
        state,
        sink,
        limiter,
        clients.control,
        pool,
        lines,
        figures,
        progress,
        admission,
        sweeper,
        shipper,
        policy,
        dispatcher,
        evaluator,
        times,
        desk,
    )


def _figures(config: Config, state: RunState, sink: TrainSink) -> RunFigures:
    """What the stall watch, the progress line, the watch that stops a run without
    progress and `progress.json` read the run through; the stall watch's clock starts now."""
    return RunFigures(
        state,
        sink,
        StallWatch(config.progress.stall_warning_s, trio.current_time()),
        ProgressReporter(config.progress.report_interval_s),
        config.batch.size,
        config.inference.max_inflight,
        ProgressWatch(
            config.progress.no_progress_stop_s,
            MIN_BATCHES * config.batch.size,
            RewardRange(
                config.batch.curriculum_min_mean_reward, config.batch.curriculum_max_mean_reward
            ),
        ),
    )
