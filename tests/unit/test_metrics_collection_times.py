"""The collection timer the daemon's collector reports to."""

from __future__ import annotations

from orchestrator.metrics import COLLECTION_BUCKETS, CollectionTimes


def test_nothing_observed_is_an_empty_histogram_and_no_latest() -> None:
    times = CollectionTimes()
    assert times.last_s is None
    snapshot = times.durations_snapshot()
    assert snapshot.bounds == COLLECTION_BUCKETS
    assert snapshot.count == 0
    assert set(snapshot.cumulative_counts) == {0}


def test_collection_times_keep_a_histogram_and_the_latest() -> None:
    times = CollectionTimes()
    assert times.last_s is None
    times.observe_collection(0.04)
    times.observe_collection(12.0)
    assert times.last_s == 12.0
    snapshot = times.durations_snapshot()
    assert snapshot.count == 2
    assert snapshot.sum == 12.04
    cumulative = dict(zip(snapshot.bounds, snapshot.cumulative_counts, strict=True))
    assert cumulative[0.05] == 1
    assert cumulative[10.0] == 1
    assert cumulative[30.0] == 2
