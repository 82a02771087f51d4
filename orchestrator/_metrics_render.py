"""The daemon's metric families, named and explained, from a `MetricsSnapshot`."""

from __future__ import annotations

from orchestrator._metrics_format import (
    MetricFamily,
    counter,
    gauge,
    histogram,
    labelled,
    render_families,
)
from orchestrator._metrics_snapshot import MetricsSnapshot

PREFIX = "orchestrator_"


def metric_families(snapshot: MetricsSnapshot) -> list[MetricFamily]:
    """The families the endpoint serves, every one present even when it has no sample."""
    s, p = snapshot, PREFIX
    return [
        labelled(
            f"{p}rollouts_total",
            "counter",
            "Rollouts finished, by outcome (completed, failed, poisoned).",
            "outcome",
            s.rollouts,
        ),
        labelled(
            f"{p}rollout_failures_total",
            "counter",
            "Failed inference requests and poisoned payloads, by kind.",
            "kind",
            s.failures,
        ),
        labelled(
            f"{p}discards_total",
            "counter",
            "Units (samples, or rollouts without samples) discarded by the sink, by reason.",
            "reason",
            s.discards,
        ),
        labelled(
            f"{p}payload_files_deleted_total",
            "counter",
            "Payload files deleted, by path (discard, sweep, collection, wipe).",
            "path",
            s.files_deleted,
        ),
        labelled(
            f"{p}payload_bytes_deleted_total",
            "counter",
            "Payload bytes deleted, by path (discard, sweep, collection, wipe).",
            "path",
            s.bytes_deleted,
        ),
        counter(
            f"{p}payload_files_written_total",
            "Payload files written by inference servers for this run's rollouts.",
            s.payload_files_written,
        ),
        counter(
            f"{p}payload_bytes_written_total",
            "Payload bytes written by inference servers for this run's rollouts.",
            s.payload_bytes_written,
        ),
        gauge(
            f"{p}payload_disk_bytes",
            "Bytes under the payload root at the last measurement.",
            s.payload_disk_bytes,
        ),
        gauge(
            f"{p}payload_disk_peak_bytes",
            "The most bytes measured under the payload root during this run.",
            s.payload_disk_peak_bytes,
        ),
        gauge(
            f"{p}applied_version",
            "The policy version rollouts are dispatched under.",
            s.applied_version,
        ),
        gauge(f"{p}step", "The last batch shipped to the trainer (0 before the first).", s.step),
        gauge(
            f"{p}collection_bound",
            "The last collection bound: every v<k> directory with k below it was deleted.",
            s.bound,
        ),
        gauge(
            f"{p}staleness_steps",
            "Batches shipped ahead of the applied policy version (step - applied_version).",
            s.staleness,
        ),
        gauge(
            f"{p}inflight_rollouts", "Rollouts dispatched and not finished.", s.inflight_rollouts
        ),
        gauge(
            f"{p}queued_samples",
            "Scored samples waiting in the sink for a batch.",
            s.queued_samples,
        ),
        counter(
            f"{p}samples_shipped_total",
            "Samples shipped to the trainer in batches.",
            s.samples_shipped,
        ),
        histogram(
            f"{p}collection_duration_seconds",
            "Duration of each payload version collection.",
            s.collection_durations,
        ),
        gauge(
            f"{p}collection_last_duration_seconds",
            "Duration of the latest payload version collection.",
            s.last_collection_s,
        ),
        histogram(
            f"{p}event_loop_lag_seconds",
            "How late the event loop woke the lag monitor, per wake-up.",
            s.loop_lag,
        ),
        gauge(
            f"{p}event_loop_worst_lag_seconds",
            "The worst event loop lag within the monitor's window (a minute by default).",
            s.worst_loop_lag_s,
        ),
    ]


def render_metrics(snapshot: MetricsSnapshot) -> str:
    """The snapshot in the Prometheus text exposition format 0.0.4."""
    return render_families(metric_families(snapshot))
