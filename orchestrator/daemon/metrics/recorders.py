"""What the daemon measures as it runs, beyond its state: collection durations and event
loop lag, each a `prometheus_client.Histogram` plus a gauge; each recorder is a
prometheus-client collector (`collect()`) of its two families.

A task that blocks the trio thread (a synchronous file walk, a slow scrape) delays every
other task; the lag monitor sees it as a late wake-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import attrs
import trio
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

# A collection is a directory walk and many unlinks: milliseconds on a small run, minutes
# for hundreds of thousands of files on a slow NFS server.
COLLECTION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# From 1 ms (a healthy loop wakes well within it) to 10 s (something blocked the thread).
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
    # registry=None: the recorder, not the library's global registry, owns it (several
    # daemons can run in one process, in tests).
    return Histogram(name, documentation, buckets=buckets, registry=None)


def histogram_family(histogram: Histogram) -> Metric:
    """The histogram's family without its `_created` sample: the endpoint serves the same
    series as before the library (buckets, `_count`, `_sum`) and nothing more."""
    (family,) = histogram.collect()
    family.samples = [s for s in family.samples if not s.name.endswith("_created")]
    return family


@attrs.define(eq=False)
class CollectionTimes:
    """Durations of the version collections so far: a histogram and the latest one."""

    durations: Histogram = attrs.field(
        factory=lambda: _histogram(
            "orchestrator_collection_duration_seconds",
            "Duration of each payload version collection.",
            COLLECTION_BUCKETS,
        )
    )
    last_s: float | None = None

    def observe_collection(self, seconds: float) -> None:
        """Record that a collection took `seconds`."""
        self.durations.observe(seconds)
        self.last_s = seconds

    def collect(self) -> Iterator[Metric]:
        yield histogram_family(self.durations)
        yield GaugeMetricFamily(
            "orchestrator_collection_last_duration_seconds",
            "Duration of the latest payload version collection.",
            value=self.last_s,
        )


@attrs.define(eq=False)
class LoopStats:
    """Every wake-up's lag in a histogram, and the worst lag within the last `window_s`.

    The window ends at the latest wake-up, not at "now": a scrape runs on the same loop as
    the monitor, so the latest wake-up is never more than one interval (plus whatever lag
    the scrape itself suffered) old. That keeps this object free of clocks.
    The default window, a minute, is Prometheus's default scrape interval, so a scraper
    polling at least that often sees every spike in the gauge.

    Raises `ValueError` for a window that is not positive.
    """

    window_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    lag: Histogram = attrs.field(
        factory=lambda: _histogram(
            "orchestrator_event_loop_lag_seconds",
            "How late the event loop woke the lag monitor, per wake-up.",
            LOOP_LAG_BUCKETS,
        )
    )
    # (time, lag) of the wake-ups that can still be the window's worst: times increase,
    # lags strictly decrease, so the first entry is the worst (a monotonic queue).
    _candidates: deque[tuple[float, float]] = attrs.field(factory=deque, init=False)

    def record(self, now: float, lag_s: float) -> None:
        """Record a wake-up at time `now` (seconds, any monotonic clock) `lag_s` late."""
        self.lag.observe(lag_s)
        candidates = self._candidates
        while candidates and candidates[-1][1] <= lag_s:
            candidates.pop()
        candidates.append((now, lag_s))
        while candidates[0][0] < now - self.window_s:
            candidates.popleft()

    @property
    def worst_lag_s(self) -> float | None:
        """The worst lag within the window, or `None` before the first wake-up."""
        return self._candidates[0][1] if self._candidates else None

    def collect(self) -> Iterator[Metric]:
        yield histogram_family(self.lag)
        yield GaugeMetricFamily(
            "orchestrator_event_loop_worst_lag_seconds",
            "The worst event loop lag within the monitor's window (a minute by default).",
            value=self.worst_lag_s,
        )


async def serve_loop_lag_monitor(
    stats: LoopStats,
    *,
    interval_s: float = 0.01,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sleep `interval_s` at a time, forever, recording into `stats` how late each wake-up
    came (on trio's clock, so a test's `MockClock` drives it).

    Raises `ValueError` if `interval_s` is not positive.
    """
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    task_status.started()
    while True:
        deadline = trio.current_time() + interval_s
        await trio.sleep_until(deadline)
        now = trio.current_time()
        # Trio never wakes a sleeper early; the clamp only guards a clock that rounds.
        stats.record(now, max(0.0, now - deadline))
