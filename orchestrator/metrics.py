"""Prometheus metrics for the daemon: the figures, their text format, and the endpoint.

    state, sink, recorders ──snapshot_from──> MetricsSnapshot ──render_metrics──> text
    serve_metrics(listen, render): GET /metrics answers render()
    serve_loop_lag_monitor(LoopStats): how late the event loop runs
    CollectionTimes.observe_collection(seconds): how long each collection took

Wiring, in the daemon's nursery:

    loop_stats, collections = LoopStats(), CollectionTimes()
    await nursery.start(serve_loop_lag_monitor, loop_stats)
    await nursery.start(
        serve_metrics,
        config.metrics.listen,
        lambda: render_metrics(snapshot_from(state, sink, loop_stats, collections=collections)),
    )
"""

from __future__ import annotations

from orchestrator._metrics_collection_times import COLLECTION_BUCKETS as COLLECTION_BUCKETS
from orchestrator._metrics_collection_times import CollectionTimes as CollectionTimes
from orchestrator._metrics_format import CONTENT_TYPE as CONTENT_TYPE
from orchestrator._metrics_format import MetricFamily as MetricFamily
from orchestrator._metrics_format import MetricSample as MetricSample
from orchestrator._metrics_format import escape_label_value as escape_label_value
from orchestrator._metrics_format import render_families as render_families
from orchestrator._metrics_histogram import Histogram as Histogram
from orchestrator._metrics_histogram import HistogramSnapshot as HistogramSnapshot
from orchestrator._metrics_loop_lag import LOOP_LAG_BUCKETS as LOOP_LAG_BUCKETS
from orchestrator._metrics_loop_lag import LoopStats as LoopStats
from orchestrator._metrics_loop_lag import serve_loop_lag_monitor as serve_loop_lag_monitor
from orchestrator._metrics_render import metric_families as metric_families
from orchestrator._metrics_render import render_metrics as render_metrics
from orchestrator._metrics_server import BadListenAddress as BadListenAddress
from orchestrator._metrics_server import parse_listen_address as parse_listen_address
from orchestrator._metrics_server import serve_metrics as serve_metrics
from orchestrator._metrics_snapshot import MetricsSnapshot as MetricsSnapshot
from orchestrator._metrics_snapshot import snapshot_from as snapshot_from
