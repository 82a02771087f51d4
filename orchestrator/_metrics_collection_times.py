"""How long payload collections take, recorded by whoever runs them."""

from __future__ import annotations

import attrs

from orchestrator._metrics_histogram import Histogram, HistogramSnapshot

# A collection is a directory walk and many unlinks: milliseconds on a small run, minutes
# for hundreds of thousands of files on a slow NFS server.
COLLECTION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


@attrs.define
class CollectionTimes:
    """Durations of the version collections so far: a histogram and the latest one."""

    durations: Histogram = attrs.field(factory=lambda: Histogram(COLLECTION_BUCKETS))
    last_s: float | None = None

    def observe_collection(self, seconds: float) -> None:
        """Record that a collection took `seconds`."""
        self.durations.observe(seconds)
        self.last_s = seconds

    def durations_snapshot(self) -> HistogramSnapshot:
        """The duration histogram so far."""
        return self.durations.snapshot()
