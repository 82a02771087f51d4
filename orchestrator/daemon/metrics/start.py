"""The metrics service of a run: the Prometheus endpoint and the event-loop lag monitor
that feeds it, started in the daemon's nursery."""

from __future__ import annotations

import functools
import socket
from collections.abc import Sequence

import structlog
import trio

from orchestrator.core.sink import TrainSink
from orchestrator.daemon.metrics.collector import metrics_registry
from orchestrator.daemon.metrics.endpoint import serve_metrics
from orchestrator.daemon.metrics.recorders import CollectionTimes, LoopStats, serve_loop_lag_monitor
from orchestrator.daemon.run_state import RunState

log = structlog.get_logger(__name__)

#: The lag monitor's period: a fine enough view of lag for a scrape every few seconds, at
#: about 0.5% of a core.
LOOP_LAG_INTERVAL_S = 0.05


async def start_metrics(
    listen: str,
    nursery: trio.Nursery,
    state: RunState,
    sink: TrainSink,
    collections: CollectionTimes,
    *,
    sockets: Sequence[socket.socket] = (),
) -> None:
    """Start the endpoint on `listen` and the lag monitor in `nursery`.

    `collections`: what the policy watcher records collection durations in.
    `sockets`: listening sockets already bound to `listen` (`orchestrator.daemon.preflight`),
    which the endpoint takes over; without them it binds `listen` itself.
    """
    loop_stats = LoopStats()
    await nursery.start(
        functools.partial(serve_loop_lag_monitor, loop_stats, interval_s=LOOP_LAG_INTERVAL_S)
    )
    registry = metrics_registry(state, sink, loop_stats, collections)
    address = await nursery.start(
        functools.partial(serve_metrics, listen, registry, sockets=sockets)
    )
    log.info("metrics endpoint", address=f"{address[0]}:{address[1]}")
