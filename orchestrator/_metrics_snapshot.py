"""What the metrics endpoint reports, copied out of the daemon's live state at one moment."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from orchestrator._metrics_collection_times import CollectionTimes
from orchestrator._metrics_histogram import HistogramSnapshot
from orchestrator._metrics_loop_lag import LoopStats
from orchestrator.rollouts import Discard
from orchestrator.run_state import RunState
from orchestrator.sink import TrainSink

# Label values reported even at zero, so that `rate()` and alerts see a series from the
# first scrape on instead of one that appears with the first event. Values found in the
# state that are not listed here are reported too, after these.
ROLLOUT_OUTCOMES = ("completed", "failed", "poisoned", "stopped")
# The dispatcher's failure kinds: the inference client's, then its own three
# (orchestrator/rejections.py records every one).
FAILURE_KINDS = (
    "connect",
    "transport",
    "timeout",
    "http_5xx",
    "http_4xx",
    "malformed",
    "oversized",
    "poisoned_payload",
    "stitching",
    "routing_gap",
)
DISCARD_REASONS = tuple(reason.value for reason in Discard)
DELETION_PATHS = ("discard", "sweep", "collection", "wipe")

Counts = tuple[tuple[str, int], ...]


def counts_with(known: Iterable[str], counts: Mapping[str, int]) -> Counts:
    """`(key, count)` for every known key in order (0 when absent), then the other keys of
    `counts`, sorted."""
    known = tuple(known)
    extra = sorted(key for key in counts if key not in known)
    return tuple((key, int(counts.get(key, 0))) for key in (*known, *extra))


@attrs.frozen
class MetricsSnapshot:
    """Every figure the endpoint reports. `None` means not known yet (no collection has
    run, no monitor measures the loop): the family is announced without a sample."""

    rollouts: Counts  # by outcome
    failures: Counts  # by kind
    discards: Counts  # by `Discard` reason, every reason present
    files_deleted: Counts  # by path: discard, sweep, collection, wipe
    bytes_deleted: Counts
    payload_files_written: int
    payload_bytes_written: int
    payload_disk_bytes: int
    payload_disk_peak_bytes: int
    applied_version: int
    step: int  # the last batch shipped (0 before the first)
    bound: int | None  # the last collection bound
    staleness: int  # step - applied_version: batches shipped ahead of the policy
    inflight_rollouts: int
    queued_samples: int
    samples_shipped: int
    collection_durations: HistogramSnapshot | None = None
    last_collection_s: float | None = None
    loop_lag: HistogramSnapshot | None = None
    worst_loop_lag_s: float | None = None


def snapshot_from(
    state: RunState,
    sink: TrainSink,
    extra: LoopStats | None = None,
    *,
    collections: CollectionTimes | None = None,
) -> MetricsSnapshot:
    """Copy the figures out of the daemon's state, its sink and the optional recorders.

    Synchronous and without `await`, so on trio it reads one consistent moment.
    """
    step = state.next_step - 1
    return MetricsSnapshot(
        rollouts=counts_with(ROLLOUT_OUTCOMES, state.rollouts),
        failures=counts_with(FAILURE_KINDS, state.failures),
        discards=counts_with(DISCARD_REASONS, sink.counters),
        files_deleted=counts_with(DELETION_PATHS, state.files_deleted),
        bytes_deleted=counts_with(DELETION_PATHS, state.bytes_deleted),
        payload_files_written=state.files_written,
        payload_bytes_written=state.bytes_written,
        payload_disk_bytes=state.payload_bytes,
        payload_disk_peak_bytes=state.peak_payload_bytes,
        applied_version=state.applied_version,
        step=step,
        bound=state.bound,
        staleness=step - state.applied_version,
        inflight_rollouts=state.inflight_rollouts,
        queued_samples=sink.queued_samples,
        samples_shipped=sink.shipped,
        collection_durations=collections.durations_snapshot() if collections else None,
        last_collection_s=collections.last_s if collections else None,
        loop_lag=extra.lag_snapshot() if extra else None,
        worst_loop_lag_s=extra.worst_lag_s if extra else None,
    )
