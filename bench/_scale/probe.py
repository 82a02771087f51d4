"""Bench-only hooks into the daemon of this process: each shipped batch as the daemon
assembles and publishes it, and the daemon's own lag recorder."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from system_fleet import cpu_seconds, rss_bytes

import orchestrator.daemon.metrics.start as metrics_start
import orchestrator.handoff.native.store as handoff_store
from _scale.recorders import AllLags
from orchestrator.core.rollouts import TrainSample
from orchestrator.core.sink import QueuedSample, TrainSink
from orchestrator.daemon.metrics import LoopStats
from orchestrator.handoff import BATCH_FILE


@attrs.define
class Ship:
    """One shipped batch, as seen from inside the daemon's process."""

    step: int
    queued_samples: int = 0  # in the sink just before assembly
    queued_tokens: int = 0
    rss_before: int = 0
    assembled_at: float = 0.0  # time.perf_counter(), as are the times below
    completed_rollouts: int = 0
    cpu_s: float = 0.0  # the daemon process's CPU time (every thread) at assembly
    loop_cpu_s: float = 0.0  # the event loop thread's
    samples: int = 0
    tokens: int = 0
    batch_bytes: int = 0
    write_s: float = 0.0  # publish_batch, wall clock, in the worker thread
    write_cpu_s: float = 0.0  # the worker thread's CPU time over it
    published_at: float = 0.0  # time.time() when publish_batch returned
    publish_started: float = 0.0
    publish_ended: float = 0.0


@attrs.define
class Probe:
    """Bench-only hooks into the daemon of this process (see `instrumented`)."""

    last_step: int
    ships: dict[int, Ship] = attrs.Factory(dict)
    daemon_loop_stats: list[AllLags] = attrs.Factory(list)
    completed: Callable[[], int] = lambda: 0
    sink: TrainSink | None = None  # the daemon's, seen when it assembles a batch
    # The last batch's queue (just before assembly) and samples, kept for after the run.
    last_queue: list[QueuedSample] = attrs.Factory(list)
    last_samples: list[TrainSample] = attrs.Factory(list)


@contextlib.contextmanager
def instrumented(probe: Probe) -> Iterator[None]:
    """Wrap `TrainSink.assemble` (RSS and the queue just before a batch is taken),
    `publish_batch` (its duration in the worker thread) and the daemon's `LoopStats` (to
    read its lag monitor). Benchmark-only patches of this process, undone on exit."""
    assemble = TrainSink.assemble
    publish = handoff_store.publish_batch

    def timed_assemble(self: TrainSink, step: int) -> tuple[list[TrainSample], list[str]]:
        queue = self.queued()
        probe.sink = self
        ship = probe.ships.setdefault(step, Ship(step))
        ship.rss_before = rss_bytes()
        ship.queued_samples = len(queue)
        ship.queued_tokens = sum(len(q.sample.token_ids) for q in queue)
        ship.assembled_at = time.perf_counter()
        ship.completed_rollouts = probe.completed()
        ship.cpu_s, ship.loop_cpu_s = cpu_seconds(), time.thread_time()
        if step == probe.last_step:
            probe.last_queue = queue
        return assemble(self, step)

    def timed_publish(
        batches_dir: Path, step: int, samples: Sequence[TrainSample], **kwargs: Any
    ) -> Path:
        started, cpu = time.perf_counter(), time.thread_time()
        batch_dir = publish(batches_dir, step, samples, **kwargs)
        ended = time.perf_counter()
        write_s, write_cpu_s = ended - started, time.thread_time() - cpu
        ship = probe.ships.setdefault(step, Ship(step))
        ship.publish_started, ship.publish_ended = started, ended
        ship.published_at = time.time()
        ship.write_s, ship.write_cpu_s = write_s, write_cpu_s
        ship.samples = len(samples)
        ship.tokens = sum(len(sample.token_ids) for sample in samples)
        ship.batch_bytes = (batch_dir / BATCH_FILE).stat().st_size
        if step == probe.last_step:
            probe.last_samples = list(samples)
        return batch_dir

    def recorded_loop_stats() -> LoopStats:
        stats = AllLags()
        probe.daemon_loop_stats.append(stats)
        return stats

    with (
        _patched(TrainSink, "assemble", timed_assemble),
        _patched(handoff_store, "publish_batch", timed_publish),
        # `start_metrics` builds the daemon's recorder as `LoopStats()`.
        _patched(metrics_start, "LoopStats", recorded_loop_stats),
    ):
        yield


@contextlib.contextmanager
def _patched(target: object, name: str, value: object) -> Iterator[None]:
    """`target.name = value` for the block; the original back afterwards."""
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)
