"""The event loop lag monitor and its statistics, on trio's virtual clock."""

from __future__ import annotations

import math
from functools import partial

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from orchestrator.daemon.metrics import LOOP_LAG_BUCKETS, LoopStats, serve_loop_lag_monitor

NAME = "orchestrator_event_loop_lag_seconds"


@attrs.frozen
class Lag:
    """The lag histogram as the endpoint serves it."""

    count: float
    sum: float
    cumulative: dict[float, float]  # by `le`, without +Inf


def lag_of(stats: LoopStats) -> Lag:
    registry = CollectorRegistry()
    registry.register(stats)
    (histogram,) = (family for family in registry.collect() if family.name == NAME)
    buckets = {
        float(s.labels["le"]): s.value for s in histogram.samples if s.name == f"{NAME}_bucket"
    }
    assert buckets.pop(math.inf) == registry.get_sample_value(f"{NAME}_count")
    assert list(buckets) == list(LOOP_LAG_BUCKETS)
    count, total = (registry.get_sample_value(f"{NAME}_{part}") for part in ("count", "sum"))
    assert count is not None
    assert total is not None
    return Lag(count, total, buckets)


def test_nothing_recorded_means_no_worst_lag() -> None:
    stats = LoopStats()
    assert stats.worst_lag_s is None
    assert lag_of(stats).count == 0


def test_the_worst_lag_is_taken_over_the_window_ending_at_the_latest_wake_up() -> None:
    stats = LoopStats(window_s=60.0)
    stats.record(0.0, 0.5)
    stats.record(30.0, 0.1)
    stats.record(59.0, 0.2)
    assert stats.worst_lag_s == 0.5
    stats.record(60.0, 0.01)  # 0.5 at t=0 is exactly on the window's edge: still in
    assert stats.worst_lag_s == 0.5
    stats.record(61.0, 0.01)  # now it is out; 0.2 beats 0.1 and 0.01
    assert stats.worst_lag_s == 0.2
    stats.record(119.5, 0.0)
    assert stats.worst_lag_s == 0.01
    stats.record(200.0, 0.0)
    assert stats.worst_lag_s == 0.0


def test_every_wake_up_goes_into_the_histogram() -> None:
    stats = LoopStats(window_s=1.0)
    for second in range(10):
        stats.record(float(second), 0.002 * second)
    lag = lag_of(stats)
    assert lag.count == 10
    assert lag.sum == pytest.approx(0.09)
    # Lags 0, 0.002, ..., 0.018: one at most 1 ms, two at most 2.5 ms, ... all at most 25 ms.
    cumulative = lag.cumulative
    assert cumulative[0.001] == 1
    assert cumulative[0.0025] == 2
    assert cumulative[0.01] == 6
    assert cumulative[0.025] == 10


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        LoopStats(window_s=0.0)


async def test_an_idle_loop_wakes_the_monitor_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = LoopStats()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag_monitor, stats, interval_s=0.25))
        await trio.sleep(1.125)
        nursery.cancel_scope.cancel()
    assert trio.current_time() == 1.125
    lag = lag_of(stats)
    assert lag.count == 4  # woke at 0.25, 0.5, 0.75 and 1.0
    assert lag.sum == 0.0
    assert lag.cumulative[LOOP_LAG_BUCKETS[0]] == 4
    assert stats.worst_lag_s == 0.0


async def test_time_passing_without_the_loop_running_shows_as_lag(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = LoopStats()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag_monitor, stats, interval_s=0.25))
        await trio.sleep(0.125)
        # Half a second passes while this task holds the loop: what a blocking call does.
        autojump_clock.jump(0.5)
        await trio.sleep(0.125)
        # The monitor, due at 0.25, woke at 0.625; it is due again at 0.875.
        assert trio.current_time() == 0.75
        assert stats.worst_lag_s == 0.375
        lag = lag_of(stats)
        assert lag.count == 1
        assert lag.sum == 0.375
        assert lag.cumulative[0.25] == 0
        assert lag.cumulative[0.5] == 1
        nursery.cancel_scope.cancel()


async def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        await serve_loop_lag_monitor(LoopStats(), interval_s=0.0)


@settings(max_examples=100)
@given(
    window=st.sampled_from([0.5, 1.0, 5.0]),
    steps=st.lists(
        st.tuples(st.sampled_from([0.0, 0.1, 0.25, 1.0, 3.0]), st.floats(0.0, 2.0)),
        min_size=1,
        max_size=40,
    ),
)
def test_the_worst_lag_equals_a_brute_force_maximum(
    window: float, steps: list[tuple[float, float]]
) -> None:
    stats = LoopStats(window_s=window)
    seen: list[tuple[float, float]] = []
    now = 0.0
    for advance, lag in steps:
        now += advance
        stats.record(now, lag)
        seen.append((now, lag))
        assert stats.worst_lag_s == max(lag for at, lag in seen if at >= now - window)
