"""Prometheus metrics for the daemon, on prometheus-client: what is measured, how it is
read, and where it is served.

    recorders.py   CollectionTimes (fed by the policy watcher), LoopStats (fed by
                   serve_loop_lag_monitor): prometheus-client histograms plus a gauge each
    collector.py   RunCollector: the families read from RunState and TrainSink at scrape
                   time; metrics_registry: one registry per daemon run
    endpoint.py    serve_metrics: GET /metrics answers generate_latest(registry), served
                   by hypercorn on the daemon's trio loop (see its docstring for why)
    start.py       start_metrics: the endpoint and the lag monitor, started in the
                   daemon's nursery (the policy watcher gets `collections` when built)
"""

from orchestrator.daemon.metrics.collector import metrics_registry as metrics_registry
from orchestrator.daemon.metrics.endpoint import CONTENT_TYPE as CONTENT_TYPE
from orchestrator.daemon.metrics.endpoint import BadListenAddress as BadListenAddress
from orchestrator.daemon.metrics.endpoint import parse_listen_address as parse_listen_address
from orchestrator.daemon.metrics.endpoint import serve_metrics as serve_metrics
from orchestrator.daemon.metrics.recorders import COLLECTION_BUCKETS as COLLECTION_BUCKETS
from orchestrator.daemon.metrics.recorders import LOOP_LAG_BUCKETS as LOOP_LAG_BUCKETS
from orchestrator.daemon.metrics.recorders import CollectionTimes as CollectionTimes
from orchestrator.daemon.metrics.recorders import LoopStats as LoopStats
from orchestrator.daemon.metrics.recorders import serve_loop_lag_monitor as serve_loop_lag_monitor
from orchestrator.daemon.metrics.start import start_metrics as start_metrics
