"""The figures of one size, derived once from its measurements for the table, the
verdicts and the text."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import attrs

from _scale.measure import SizeResult
from _scale.workload import (
    TARGET_BYTES_PER_TOKEN,
    TARGET_READ_S_PER_MTOK,
    TARGET_WORST_LAG_S,
    TARGET_WRITE_S_PER_MTOK,
)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


@attrs.frozen
class Figures:
    """The figures of one size, derived once for the table, the verdicts and the text."""

    size: SizeResult
    worst_lag_s: float
    p99_lag_s: float
    p999_lag_s: float
    worst_lag_publishing_s: float  # stalls overlapping a batch publish
    worst_lag_otherwise_s: float
    worst_lag_without_gc_s: float  # stalls that no garbage collection over 1 ms overlaps
    publish_alone_worst_s: float
    worst_lag_loop_cpu_s: float  # the loop thread's CPU time between the worst wake-up and
    worst_lag_interval_s: float  # the one before it, and the wall time between them
    others_on_core: float  # share of the window other processes had the daemon's core
    steal: float  # share of the window the hypervisor took the daemon's core
    loop_waiting_s: float  # the loop thread's time runnable but not on a CPU, in all
    window_s: float
    daemon_worst_s: float  # in the window
    daemon_p99_s: float
    daemon_start_up_s: float  # the worst before dispatch started
    wakeups: int
    gc_worst_s: float
    gc_worst_generation: int
    gc_full: int
    rss_per_token: float
    deep_per_token: float
    array_per_token: float
    write_s_per_mtok: float  # in the run, median over the batches
    write_s: float  # in the run, median over the batches
    write_cpu_share: float
    read_s_per_mtok: float  # after the run, median of REPEATS
    read_s: float
    trainer_in_run_s: float  # median
    trainer_in_run_per_mtok: float
    rollouts_per_s: float
    tokens_per_s: float
    tokens_per_batch: float
    steady_s: float
    cpu_share: float  # of one core, the daemon's process, first to last batch
    loop_cpu_share: float  # of which the event loop's thread

    @classmethod
    def of(cls, result: SizeResult) -> Figures:
        run = result.run
        lags = [lag for _, lag in run.fine_lags]
        end = max(at for at, _ in run.fine_lags)
        worst = max(range(1, len(lags)), key=lambda i: lags[i])
        times = run.fine_thread_times
        window_s = end - run.dispatch_started
        daemon = [
            lag for at, lag in run.daemon_lags if run.dispatch_started <= at - lag and at <= end
        ]
        first_ship, ships = run.ships[0], run.ships
        last = ships[-1]
        publishing = [
            lag
            for at, lag in run.fine_lags
            if any(at - lag < s.publish_ended and at > s.publish_started for s in ships)
        ]
        otherwise = [
            lag
            for at, lag in run.fine_lags
            if not any(at - lag < s.publish_ended and at > s.publish_started for s in ships)
        ]
        gc_worst = max(run.gc_collections, key=lambda c: c[1], default=(0, 0.0, 0.0))
        pauses = [(start, start + seconds) for _, seconds, start in run.gc_collections]
        pauses = [(a, b) for a, b in pauses if b - a > 0.001]
        without_gc = [
            lag for at, lag in run.fine_lags if not any(at - lag < b and at > a for a, b in pauses)
        ]
        steady_s = last.assembled_at - first_ship.assembled_at
        rollouts = last.completed_rollouts - first_ship.completed_rollouts
        in_run = [seconds for _, seconds in result.trainer_in_run]
        tokens = {ship.step: ship.tokens for ship in ships}
        in_run_per_mtok = [
            seconds / (tokens[step] / 1e6) for step, seconds in result.trainer_in_run
        ]
        return cls(
            size=result,
            worst_lag_s=max(lags),
            p99_lag_s=percentile(lags, 0.99),
            p999_lag_s=percentile(lags, 0.999),
            worst_lag_publishing_s=max(publishing, default=0.0),
            worst_lag_otherwise_s=max(otherwise, default=0.0),
            worst_lag_without_gc_s=max(without_gc, default=0.0),
            publish_alone_worst_s=max(result.publish_alone_lags, default=0.0),
            worst_lag_loop_cpu_s=times[worst] - times[worst - 1],
            worst_lag_interval_s=run.fine_lags[worst][0] - run.fine_lags[worst - 1][0],
            others_on_core=(run.cpu.core_busy_s - run.cpu.process_cpu_s) / window_s,
            steal=run.cpu.core_steal_s / window_s,
            loop_waiting_s=run.cpu.loop_waiting_s,
            window_s=window_s,
            daemon_worst_s=max(daemon, default=0.0),
            daemon_p99_s=percentile(daemon, 0.99) if daemon else 0.0,
            daemon_start_up_s=max(
                (lag for at, lag in run.daemon_lags if at - lag < run.dispatch_started),
                default=0.0,
            ),
            wakeups=len(lags),
            gc_worst_s=gc_worst[1],
            gc_worst_generation=gc_worst[0],
            gc_full=sum(1 for generation, _, _ in run.gc_collections if generation == 2),
            rss_per_token=(first_ship.rss_before - run.rss_start) / first_ship.queued_tokens,
            deep_per_token=result.queue.deep_bytes / result.queue.tokens,
            array_per_token=result.queue.array_bytes / result.queue.tokens,
            write_s_per_mtok=statistics.median(s.write_s / (s.tokens / 1e6) for s in ships),
            write_s=statistics.median(s.write_s for s in ships),
            write_cpu_share=sum(s.write_cpu_s for s in ships) / sum(s.write_s for s in ships),
            read_s_per_mtok=result.read.median / (last.tokens / 1e6),
            read_s=result.read.median,
            trainer_in_run_s=statistics.median(in_run) if in_run else math.nan,
            trainer_in_run_per_mtok=(
                statistics.median(in_run_per_mtok) if in_run_per_mtok else math.nan
            ),
            rollouts_per_s=rollouts / steady_s,
            tokens_per_s=sum(ship.tokens for ship in ships[1:]) / steady_s,
            tokens_per_batch=statistics.fmean(ship.tokens for ship in ships),
            steady_s=steady_s,
            cpu_share=(last.cpu_s - first_ship.cpu_s) / steady_s,
            loop_cpu_share=(last.loop_cpu_s - first_ship.loop_cpu_s) / steady_s,
        )

    @property
    def lag_ok(self) -> bool:
        return max(self.worst_lag_s, self.daemon_worst_s) <= TARGET_WORST_LAG_S

    @property
    def memory_ok(self) -> bool:
        return max(self.rss_per_token, self.deep_per_token) <= TARGET_BYTES_PER_TOKEN

    @property
    def write_ok(self) -> bool:
        return self.write_s_per_mtok < TARGET_WRITE_S_PER_MTOK

    @property
    def read_ok(self) -> bool:
        return self.read_s_per_mtok < TARGET_READ_S_PER_MTOK


def marginal_rss(figures: list[Figures]) -> float | None:
    """RSS growth per queued token between the smallest and the largest size: the slope,
    free of what the first batch costs whatever its size."""
    if len(figures) < 2:
        return None
    small = min(figures, key=lambda f: f.size.run.size)
    large = max(figures, key=lambda f: f.size.run.size)

    def growth(f: Figures) -> tuple[int, int]:
        first = f.size.run.ships[0]
        return first.rss_before - f.size.run.rss_start, first.queued_tokens

    (rss_a, tokens_a), (rss_b, tokens_b) = growth(small), growth(large)
    return (rss_b - rss_a) / (tokens_b - tokens_a) if tokens_b != tokens_a else None


def gc_within(collections: list[tuple[int, float, float]], start: float, end: float) -> float:
    """Seconds of garbage collection between `start` and `end` (perf_counter)."""
    return sum(
        min(end, at + seconds) - max(start, at)
        for _, seconds, at in collections
        if at < end and at + seconds > start
    )


def laggiest(figures: list[Figures]) -> Figures:
    """The size whose worst lag (either monitor) is the worst."""
    return max(figures, key=lambda f: max(f.worst_lag_s, f.daemon_worst_s))
