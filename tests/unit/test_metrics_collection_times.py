"""The collection timer the daemon's collector reports to, read back from a registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from orchestrator.daemon.metrics import COLLECTION_BUCKETS, CollectionTimes

NAME = "orchestrator_collection_duration_seconds"
LAST = "orchestrator_collection_last_duration_seconds"


def registry_of(times: CollectionTimes) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(times)
    return registry


def bucket(registry: CollectorRegistry, le: float) -> float | None:
    return registry.get_sample_value(f"{NAME}_bucket", {"le": str(le)})


def test_nothing_observed_is_an_empty_histogram_and_no_latest() -> None:
    times = CollectionTimes()
    registry = registry_of(times)
    assert times.last_s is None
    assert registry.get_sample_value(LAST) is None
    assert registry.get_sample_value(f"{NAME}_count") == 0
    assert [bucket(registry, le) for le in COLLECTION_BUCKETS] == [0] * len(COLLECTION_BUCKETS)
    assert registry.get_sample_value(f"{NAME}_bucket", {"le": "+Inf"}) == 0


def test_collection_times_keep_a_histogram_and_the_latest() -> None:
    times = CollectionTimes()
    registry = registry_of(times)
    times.observe_collection(0.04)
    times.observe_collection(12.0)
    assert times.last_s == 12.0
    assert registry.get_sample_value(LAST) == 12.0
    assert registry.get_sample_value(f"{NAME}_count") == 2
    assert registry.get_sample_value(f"{NAME}_sum") == 12.04
    assert bucket(registry, 0.025) == 0
    assert bucket(registry, 0.05) == 1
    assert bucket(registry, 10.0) == 1
    assert bucket(registry, 30.0) == 2
    # No `_created` series: the endpoint serves what it served before the library.
    names = {sample.name for family in registry.collect() for sample in family.samples}
    assert names == {f"{NAME}_bucket", f"{NAME}_count", f"{NAME}_sum", LAST}
