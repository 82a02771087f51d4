"""Real scale: batches of 256 and 512 rollouts of ~4,500 tokens (a million tokens a step and
more) without stalling the daemon's event loop.

A real step is 512 rollouts of about 4,500 tokens: 2.3M tokens. Per batch size, one run of
single-turn "math" rollouts (prompts of 3,900..4,100 tokens, completions of ~500: max_tokens
700, of which the simulated model samples 72% on average), groups of 8, payloads by
handle, and a payload-light model (1 layer, top-8 of 128 experts: the payload files are
small, so the disk is not what is measured). Each size runs in a fresh process (this
script with --worker), where the daemon runs, pinned to core 0, with the metrics
endpoint on (so its own event-loop lag monitor runs); 2 inference servers (`orchestrator
sim-inference`) and the trainer (`orchestrator sim-trainer`, zero train time) are
separate processes on the other core.

Measured per size:

- event-loop lag: the daemon's own monitor (`serve_loop_lag_monitor`, 50 ms wake-ups,
  what `/metrics` serves; its recorder keeps every wake-up here) and the same monitor run
  by the benchmark on the same loop with 1 ms wake-ups: worst, p99 and p99.9 from dispatch
  start to the last shipped batch, and the worst during start-up;
- RSS per queued token: (VmRSS just before the first batch is assembled - VmRSS when the
  daemon starts dispatching) / the tokens queued in the sink then; and the deep size of
  the sink's queued samples (`QueuedSample`s, their arrays, strings and segments) per
  token, just before the last batch is assembled;
- batch write time: `publish_batch` (encode, write, fsync, rename) timed in the daemon's
  worker thread as it ships each batch, and the last batch's samples published again
  after the run with the fleet stopped (with and without fsync, and under cProfile);
- trainer read time: in the run, from the trainer's `trained` log lines (read + publish
  of a version, the trainer sharing its core with the servers); after the run,
  `read_batch(verify=True)` on the last shipped batch, which the trainer is left not to
  train on (its payload files stay pinned), with the fleet stopped (and under cProfile);
- rollouts per second from the first shipped batch to the last.

Where the loop's time goes: every garbage collection is timed (`gc.callbacks`), a trio
instrument times each pass of the event loop by task, and one more, unreported run of
the largest size has the event loop's thread under cProfile. The report says which
targets are met and, for those that are not, where the time goes.

    uv run --frozen --group bench python bench/system_scale.py [--sizes 256 512] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import functools
import gc
import json
import math
import os
import pickle
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from _report import git_revision, machine, write_section
from system_fleet import (
    CorePlan,
    ModelShape,
    cpu_seconds,
    demo_config,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    rss_bytes,
    run_overrides,
    running_daemon,
    sim_servers,
    sim_trainer,
    stamp,
)

import orchestrator.daemon.run as daemon_run
import orchestrator.handoff.store as handoff_store
from orchestrator.core.rollouts import TrainSample
from orchestrator.core.sink import QueuedSample, TrainSink
from orchestrator.daemon.metrics import LoopStats, serve_loop_lag_monitor
from orchestrator.handoff import BATCH_FILE, Batch, batch_step_dir, read_batch

TARGET_WORST_LAG_S = 0.020
TARGET_BYTES_PER_TOKEN = 16.0
TARGET_WRITE_S_PER_MTOK = 0.2
TARGET_READ_S_PER_MTOK = 0.1

SIZES = (256, 512)
GROUP_SIZE = 8
PROMPT_MIN, PROMPT_MAX = 3_900, 4_100
# The simulated model stops at a length drawn from [max_tokens / 8, 1.5 max_tokens]
# (capped at max_tokens): 0.72 max_tokens on average, ~505 tokens here.
MAX_TOKENS = 700
SHAPE = ModelShape(layers=1, top_k=8, num_experts=128)
SERVERS = 2
MAX_INFLIGHT = 64
FINE_LAG_INTERVAL_S = 0.001
# How often the benchmark looks at the run (RSS, shipped batches) from the daemon's loop.
POLL_S = 0.25
REPEATS = 5
TOP_FUNCTIONS = 8
TRAINER_GRACE_S = 60.0
PROFILE_STEPS = 3
# Task steps at least this long are kept with where they suspended.
LONG_STEP_S = 0.005


# -- what the benchmark records while the daemon runs ---------------------------------------


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
        _patched(daemon_run, "LoopStats", recorded_loop_stats),
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


@attrs.define(eq=False)
class AllLags(LoopStats):
    """The daemon's lag recorder that also keeps every wake-up's (time, lag)."""

    wakeups: list[tuple[float, float]] = attrs.Factory(list)  # (time.perf_counter(), lag)
    # The recording thread's CPU time (time.thread_time()) at each wake-up.
    thread_times: list[float] = attrs.Factory(list)

    def record(self, now: float, lag_s: float) -> None:
        self.wakeups.append((time.perf_counter(), lag_s))
        self.thread_times.append(time.thread_time())
        super().record(now, lag_s)


@attrs.define
class GcTimes:
    """Every garbage collection of this process, timed (`gc.callbacks`): a collection
    holds the interpreter lock, so it stalls the event loop whichever thread runs it."""

    # (generation, seconds, time.perf_counter() at its start)
    collections: list[tuple[int, float, float]] = attrs.Factory(list)
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            seconds = time.perf_counter() - self._started
            self.collections.append((info["generation"], seconds, self._started))

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcTimes]:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


class LoopPasses(trio.abc.Instrument):
    """Where a long event-loop pass goes: trio runs every runnable task once per pass
    (between two waits for I/O), and a timer such as the lag monitor's is looked at only
    between passes, so a pass's length is the lag it can cause. For every pass longer
    than `threshold_s`, the time its task steps took, by task (coroutine function)."""

    def __init__(self, threshold_s: float = 0.010) -> None:
        self.threshold_s = threshold_s
        # (seconds, task steps, step time by task) of each long pass
        self.long_passes: list[tuple[float, int, dict[str, float]]] = []
        self.by_task: defaultdict[str, float] = defaultdict(float)  # in long passes
        self.steps_in_long: Counter[str] = Counter()
        # The longest single task steps: (seconds, task, where it suspended after, start).
        self.long_steps: list[tuple[float, str, str, float]] = []
        # None until the first pass that began after the instrument was added.
        self._pass_started: float | None = None
        self._step_started: float | None = None
        self._steps: defaultdict[str, float] = defaultdict(float)
        self._count: Counter[str] = Counter()

    def after_io_wait(self, timeout: float) -> None:
        self._pass_started = time.perf_counter()
        self._steps.clear()
        self._count.clear()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._step_started is None:
            return
        seconds = time.perf_counter() - self._step_started
        name = ".".join(task.name.rsplit(".", 2)[-2:])  # Class.method or module.function
        self._steps[name] += seconds
        self._count[name] += 1
        if seconds >= LONG_STEP_S:
            where = _suspended_at(task.coro)
            self.long_steps.append((seconds, name, where, self._step_started))

    def before_io_wait(self, timeout: float) -> None:
        if self._pass_started is None:
            return  # the pass in which we were added: not timed whole
        length = time.perf_counter() - self._pass_started
        if length >= self.threshold_s:
            self.long_passes.append((length, self._count.total(), dict(self._steps)))
            for name, seconds in self._steps.items():
                self.by_task[name] += seconds
            self.steps_in_long.update(self._count)


def _suspended_at(coroutine: Any) -> str:
    """The innermost daemon frames a task's coroutine is suspended in, innermost first."""
    frames = []
    while coroutine is not None:
        frame = getattr(coroutine, "cr_frame", None) or getattr(coroutine, "ag_frame", None)
        if frame is not None:
            frames.append(frame)
        coroutine = getattr(coroutine, "cr_await", None) or getattr(coroutine, "ag_await", None)
    names = [
        _function_name(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        for f in reversed(frames)
        if "/orchestrator/" in f.f_code.co_filename
    ]
    return " <- ".join(names[:3]) or "?"


@attrs.frozen
class CpuSnapshot:
    """Who had the daemon's core, read at the window's ends: the core's busy time and the
    hypervisor's steal (/proc/stat), the daemon process's CPU time, and the event loop
    thread's time on a CPU and waiting for one (/proc/thread-self/schedstat)."""

    core_busy_s: float
    core_steal_s: float
    process_cpu_s: float
    loop_on_cpu_s: float
    loop_waiting_s: float

    @classmethod
    def now(cls, core: int | None) -> CpuSnapshot:
        busy = steal = 0.0
        if core is not None:
            tick = os.sysconf("SC_CLK_TCK")
            for line in Path("/proc/stat").read_text().splitlines():
                if line.startswith(f"cpu{core} "):
                    user, nice, system, _, _, irq, softirq, stolen = map(int, line.split()[1:9])
                    busy = (user + nice + system + irq + softirq) / tick
                    steal = stolen / tick
        try:
            on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
        except (OSError, ValueError):
            on_cpu = waiting = "0"
        return cls(busy, steal, cpu_seconds(), int(on_cpu) / 1e9, int(waiting) / 1e9)

    def __sub__(self, other: CpuSnapshot) -> CpuSnapshot:
        return CpuSnapshot(
            *(a - b for a, b in zip(attrs.astuple(self), attrs.astuple(other), strict=True))
        )


@attrs.frozen
class GcHeap:
    """What a full garbage collection walks, just after the last batch (the daemon still
    running): tracked objects, the references it follows, those that are the items of
    lists and tuples of at least `INT_RUN` Python ints (token ids held as Python objects),
    and how long a full collection takes then."""

    tracked: int  # not counting frozen objects (`gc.freeze`), which no collection walks
    frozen: int
    references: int
    int_references: int
    int_sequences: int
    full_collection_s: float


INT_RUN = 1_000


def gc_heap() -> GcHeap:
    objects = gc.get_objects()
    references = int_references = int_sequences = 0
    for obj in objects:
        count = len(gc.get_referents(obj))
        references += count
        if (
            isinstance(obj, list | tuple)
            and len(obj) >= INT_RUN
            and type(obj[0]) is int
            and type(obj[-1]) is int
        ):
            int_references += count
            int_sequences += 1
    tracked = len(objects)
    del objects
    started = time.perf_counter()
    gc.collect()
    return GcHeap(
        tracked=tracked,
        frozen=gc.get_freeze_count(),
        references=references,
        int_references=int_references,
        int_sequences=int_sequences,
        full_collection_s=time.perf_counter() - started,
    )


@attrs.frozen
class RunResult:
    size: int
    steps: int
    ships: list[Ship]
    rss_start: int
    rss_peak: int
    dispatch_started: float  # time.perf_counter()
    fine_lags: list[tuple[float, float]]
    # The daemon's own monitor (50 ms wake-ups): every wake-up of the run, start-up included.
    daemon_lags: list[tuple[float, float]]
    fine_start_up_s: float  # the 1 ms monitor's worst lag that began before dispatch
    # The 1 ms monitor's thread CPU time at each of `fine_lags`' wake-ups.
    fine_thread_times: list[float]
    cpu: CpuSnapshot  # over the window: dispatch start to the last batch
    discards: dict[str, int]
    rollouts: dict[str, int]
    run_dir: Path
    # (generation, seconds, perf_counter at start), dispatch to the last batch
    gc_collections: list[tuple[int, float, float]]
    gc_tracked: int  # objects the collector tracks, after the last batch
    gc_heap: GcHeap
    # Passes of the event loop longer than LoopPasses' threshold (empty unless timed):
    # (seconds, task steps, step time by task), and their step time and steps by task.
    long_passes: list[tuple[float, int, dict[str, float]]]
    long_pass_time: dict[str, float]
    long_pass_steps: Counter[str]
    long_steps: list[tuple[float, str, str, float]]


async def _run_daemon(
    overrides: list[str], probe: Probe, size: int, time_passes: bool
) -> RunResult:
    config = demo_config(overrides)
    fine = AllLags(window_s=1e9)
    pinned = os.sched_getaffinity(0)
    core = next(iter(pinned)) if len(pinned) == 1 else None
    passes = LoopPasses()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(serve_loop_lag_monitor, fine, interval_s=FINE_LAG_INTERVAL_S)
        )
        async with running_daemon(config) as run:
            state = run.state
            probe.completed = lambda: state.rollouts["completed"]
            with contextlib.ExitStack() as stack:
                gc_times = stack.enter_context(GcTimes().installed())
                if time_passes:
                    trio.lowlevel.add_instrument(passes)
                    stack.callback(trio.lowlevel.remove_instrument, passes)
                rss_start, started = rss_bytes(), time.perf_counter()
                cpu_start = CpuSnapshot.now(core)
                rss_peak = rss_start
                reported = 0
                while state.next_step <= probe.last_step:
                    if run.outcome is not None:
                        raise RuntimeError("system_scale: the run ended before its last batch")
                    await trio.sleep(POLL_S)
                    rss_peak = max(rss_peak, rss_bytes())
                    if state.next_step - 1 > reported:
                        reported = state.next_step - 1
                        print(
                            f"{stamp()}   batch {reported} of {size} shipped: "
                            f"{state.rollouts['completed']:,} rollouts completed, "
                            f"RSS {rss_bytes() / 2**20:.0f} MiB",
                            flush=True,
                        )
                # The last batch's publish has returned (next_step moves after it).
                end = time.perf_counter()
                cpu = CpuSnapshot.now(core) - cpu_start
                gc_collections = list(gc_times.collections)
            daemon_lags = [w for stats in probe.daemon_loop_stats for w in stats.wakeups]
            rollouts = dict(state.rollouts)
            discards = dict(probe.sink.counters) if probe.sink is not None else {}
            # Outside the window the figures cover: what a full collection walks.
            heap = gc_heap()
            # Let the trainer log its last step (it stops one short of the daemon's).
            with trio.move_on_after(TRAINER_GRACE_S):
                while state.applied_version < probe.last_step - 1:
                    await state.wait_changed()
        nursery.cancel_scope.cancel()
    return RunResult(
        size=size,
        steps=probe.last_step,
        ships=[probe.ships[step] for step in sorted(probe.ships)],
        rss_start=rss_start,
        rss_peak=rss_peak,
        dispatch_started=started,
        # A stall counts in the window when it began in it: the first wake-up after
        # dispatch starts may still carry the daemon's start-up.
        fine_lags=[(t, lag) for t, lag in fine.wakeups if started <= t - lag and t <= end],
        fine_thread_times=[
            cpu_time
            for (t, lag), cpu_time in zip(fine.wakeups, fine.thread_times, strict=True)
            if started <= t - lag and t <= end
        ],
        fine_start_up_s=max((lag for t, lag in fine.wakeups if t - lag < started), default=0.0),
        cpu=cpu,
        daemon_lags=daemon_lags,
        discards=discards,
        rollouts=rollouts,
        run_dir=config.run_dir,
        gc_collections=gc_collections,
        gc_tracked=heap.tracked,
        gc_heap=heap,
        long_passes=passes.long_passes,
        long_pass_time=dict(passes.by_task),
        long_pass_steps=passes.steps_in_long,
        long_steps=sorted(passes.long_steps, reverse=True),
    )


def workload_overrides(size: int, steps: int) -> list[str]:
    return [
        f"max_steps={steps}",
        'env.name="math"',
        f"env.prompt_len_min={PROMPT_MIN}",
        f"env.prompt_len_max={PROMPT_MAX}",
        f"env.max_tokens={MAX_TOKENS}",
        "env.max_turns=1",
        # Keep every group with a learning signal: fewer rollouts thrown away per batch.
        "env.curriculum_min_mean_reward=0.0",
        f"batch.size={size}",
        f"batch.group_size={GROUP_SIZE}",
        "batch.max_seq_len=8192",
        f"inference.max_inflight={MAX_INFLIGHT}",
        "staleness.max_off_policy_steps=2",
        "staleness.max_async_steps=1",
        'payload.mode="by_handle"',
        "sim.train_time_s=0.0",
        "trainer.poll_interval_s=0.05",
        'metrics.listen="127.0.0.1:0"',
    ]


# -- after the run: the last batch read and written again, the queue's deep size -------------


@attrs.frozen
class Timed:
    seconds: list[float]
    profile: list[tuple[float, float, str]]  # (own s, cumulative s, function)
    # What the call produced, for the report (bytes of arrays read, by kind).
    detail: dict[str, float] = attrs.Factory(dict)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _profiled(fn: Callable[[], object]) -> list[tuple[float, float, str]]:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return _profile_rows(profile)[:TOP_FUNCTIONS]


def _profile_rows(profile: cProfile.Profile) -> list[tuple[float, float, str]]:
    """(own seconds, cumulative seconds, function) of every function, most own time first."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [
        (own, cumulative, _function_name(file, line, name))
        for (file, line, name), (_, _, own, cumulative, _) in stats.items()
    ]
    rows.sort(reverse=True)
    return rows


def _function_name(file: str, line: int, name: str) -> str:
    if file == "~":
        return name  # a C function: "<built-in method ...>"
    if "/site-packages/" in file:
        file = file.split("/site-packages/", 1)[1]
    elif "/orchestrator/" in file:
        file = "orchestrator/" + file.rsplit("/orchestrator/", 1)[1]
    else:
        file = re.sub(r"^.*/lib/python3\.\d+/", "", file)
    return f"{name} ({file}:{line})"


def time_read(batch_dir: Path, expected: int) -> Timed:
    """`read_batch(verify=True)` as the sim trainer calls it, timed `REPEATS` times and
    once under cProfile."""

    def read() -> Batch:
        return read_batch(batch_dir, verify=True, on_corrupt="drop")

    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        batch = read()
        seconds.append(time.perf_counter() - started)
        if len(batch.samples) != expected or batch.dropped:
            raise RuntimeError(
                f"system_scale: read {len(batch.samples)} samples of {expected} from "
                f"{batch_dir}, {len(batch.dropped)} dropped"
            )
    samples = batch.samples
    masks = [s.sampling_mask for s in samples if s.sampling_mask is not None]
    detail = {
        "positions": float(sum(len(s.token_ids) for s in samples)),
        "loss_positions": float(sum(int(np.count_nonzero(s.loss_mask)) for s in samples)),
        "mask_bytes": float(sum(mask.nbytes for mask in masks)),
        "mask_width": float(max((mask.shape[1] for mask in masks), default=0)),
        "routing_bytes": float(
            sum(s.routed_experts.nbytes for s in samples if s.routed_experts is not None)
        ),
    }
    del batch, samples, masks
    return Timed(seconds, _profiled(read), detail)


def time_write(samples: list[TrainSample], step: int, base: Path, *, fsync: bool) -> Timed:
    count = 0

    def write() -> None:
        nonlocal count
        count += 1
        target = base / f"republish-{'fsync' if fsync else 'nofsync'}-{count}"
        handoff_store.publish_batch(target, step, samples, fsync=fsync)

    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        write()
        seconds.append(time.perf_counter() - started)
    return Timed(seconds, _profiled(write))


def publish_alone_lags(samples: list[TrainSample], step: int, base: Path) -> list[float]:
    """Lags of an otherwise idle event loop (the 1 ms monitor alone) while the batch is
    published from a worker thread as the daemon does (`publish_batch_async`, fsync),
    `REPEATS` times: what publishing costs the loop by itself (the interpreter lock, and
    the one core the daemon's threads share)."""

    async def main() -> list[float]:
        lags = AllLags(window_s=1e9)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_loop_lag_monitor, lags, interval_s=FINE_LAG_INTERVAL_S)
            )
            for attempt in range(REPEATS):
                await trio.sleep(0.1)
                await handoff_store.publish_batch_async(base / f"alone-{attempt}", step, samples)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        return [lag for _, lag in lags.wakeups]

    return trio.run(main)


def deep_size(root: object) -> int:
    """Bytes of `root` and everything it reaches (numpy data included; not types, modules
    or functions); each object counted once."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)  # an array that owns its data counts it here
        if isinstance(obj, np.ndarray):
            if obj.base is not None:
                stack.append(obj.base)
            continue
        stack.extend(gc.get_referents(obj))
    return total


@attrs.frozen
class QueueCost:
    samples: int
    tokens: int
    deep_bytes: int
    array_bytes: int  # token_ids + loss_mask + logprobs


def queue_cost(queue: list[QueuedSample]) -> QueueCost:
    arrays = sum(
        q.sample.token_ids.nbytes + q.sample.loss_mask.nbytes + q.sample.logprobs.nbytes
        for q in queue
    )
    return QueueCost(
        samples=len(queue),
        tokens=sum(len(q.sample.token_ids) for q in queue),
        deep_bytes=deep_size(queue),
        array_bytes=arrays,
    )


def trainer_reads(log_path: Path, ships: list[Ship]) -> list[tuple[int, float]]:
    """Per step the trainer trained on: seconds from the batch being published (or the
    previous step's `trained` line, if later) to its `trained` line."""
    trained: dict[int, float] = {}
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "trained":
            at = datetime.datetime.fromisoformat(entry["timestamp"]).timestamp()
            trained[int(entry["step"])] = at
    published = {ship.step: ship.published_at for ship in ships}
    reads = []
    for step in sorted(trained):
        if step not in published:
            continue
        start = max(published[step], trained.get(step - 1, -math.inf))
        reads.append((step, trained[step] - start))
    return reads


@attrs.frozen
class SizeResult:
    run: RunResult
    queue: QueueCost
    trainer_in_run: list[tuple[int, float]]
    read: Timed
    write_fsync: Timed
    write_nofsync: Timed
    publish_alone_lags: list[float]
    wall_s: float
    # With profile_loop: the event loop thread under cProfile, every function (own time
    # first), and the seconds profiled.
    loop_profile: list[tuple[float, float, str]] | None = None
    loop_profile_s: float = 0.0


def measure_size(
    size: int,
    steps: int,
    base: Path,
    cores: CorePlan,
    *,
    time_passes: bool,
    profile_loop: bool = False,
) -> SizeResult:
    """One run of batches of `size` under `base` (a fresh directory per call)."""
    started = time.perf_counter()
    base.mkdir(parents=True, exist_ok=False)
    run_dir = base / f"run-{size}"
    probe = Probe(last_step=steps)
    trainer_log = base / f"trainer-{size}.log"
    with sim_servers(SERVERS, SHAPE, cores.fleet) as urls:
        overrides = run_overrides(run_dir, urls, SHAPE, workload_overrides(size, steps))
        # The trainer stops one batch short: the last batch and its payload files stay
        # (pinned until a version that never comes) for the read timed after the run.
        trainer_overrides = [*overrides, f"max_steps={steps - 1}"]
        with sim_trainer(trainer_overrides, cores.fleet, trainer_log), instrumented(probe):
            profile = cProfile.Profile() if profile_loop else None
            profiled_from = time.perf_counter()
            if profile is not None:
                profile.enable()  # this thread only: the event loop's
            try:
                run = trio.run(_run_daemon, overrides, probe, size, time_passes)
            finally:
                if profile is not None:
                    profile.disable()
            profiled_s = time.perf_counter() - profiled_from
    # The fleet is stopped: what follows has both cores to itself.
    print(f"{stamp()}   timing the last batch's read and write", flush=True)
    last = run.ships[-1]
    read = time_read(batch_step_dir(run_dir / "batches", last.step), last.samples)
    write_fsync = time_write(probe.last_samples, last.step, base / f"writes-{size}", fsync=True)
    write_nofsync = time_write(probe.last_samples, last.step, base / f"writes-{size}", fsync=False)
    queue = queue_cost(probe.last_queue)
    alone = publish_alone_lags(probe.last_samples, last.step, base / f"writes-{size}")
    result = SizeResult(
        run=run,
        queue=queue,
        trainer_in_run=trainer_reads(trainer_log, run.ships),
        read=read,
        write_fsync=write_fsync,
        write_nofsync=write_nofsync,
        publish_alone_lags=alone,
        wall_s=time.perf_counter() - started,
        loop_profile=None if profile is None else _profile_rows(profile),
        loop_profile_s=profiled_s,
    )
    probe.last_queue.clear()
    probe.last_samples.clear()
    return result


# -- the report -------------------------------------------------------------------------------


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:,.1f} ms"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


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
            p99_lag_s=_percentile(lags, 0.99),
            p999_lag_s=_percentile(lags, 0.999),
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
            daemon_p99_s=_percentile(daemon, 0.99) if daemon else 0.0,
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


def _profile_table(title: str, timed: Timed) -> list[str]:
    return [
        f"{title} (cProfile, one call; {_ms(timed.median)} unprofiled; own time first):",
        "",
        "| own | cumulative | function |",
        "|---:|---:|---|",
        *(
            f"| {_ms(own)} | {_ms(cumulative)} | `{name}` |"
            for own, cumulative, name in timed.profile
        ),
        "",
    ]


def _table(figures: list[Figures]) -> list[str]:
    def row(label: str, cells: Sequence[str], target: str = "") -> str:
        return f"| {label} | " + " | ".join(cells) + f" | {target} |"

    lag_target = f"<= {_ms(TARGET_WORST_LAG_S)}"
    memory_target = f"<= {TARGET_BYTES_PER_TOKEN:.0f} B"
    return [
        "| | " + " | ".join(f"{f.size.run.size} samples" for f in figures) + " | target |",
        "|---|" + "---:|" * len(figures) + "---|",
        row(
            "tokens per batch (mean)",
            [
                f"{f.tokens_per_batch / 1e6:.2f}M ({f.tokens_per_batch / f.size.run.size:,.0f} "
                "a sample)"
                for f in figures
            ],
        ),
        row("batches shipped", [str(f.size.run.steps) for f in figures]),
        row(
            "worst event-loop lag, 1 ms monitor",
            [f"**{_ms(f.worst_lag_s)}**" for f in figures],
            lag_target,
        ),
        row(
            "p99 / p99.9 lag, 1 ms monitor",
            [f"{_ms(f.p99_lag_s)} / {_ms(f.p999_lag_s)} ({f.wakeups:,} wake-ups)" for f in figures],
        ),
        row(
            "worst lag, daemon's own monitor (50 ms wake-ups)",
            [f"**{_ms(f.daemon_worst_s)}**" for f in figures],
            lag_target,
        ),
        row(
            "p99 lag, daemon's own monitor",
            [_ms(f.daemon_p99_s) for f in figures],
        ),
        row(
            "worst lag of the start-up (before dispatch), 1 ms / daemon's monitor",
            [f"{_ms(f.size.run.fine_start_up_s)} / {_ms(f.daemon_start_up_s)}" for f in figures],
        ),
        row(
            "worst lag while a batch is published / otherwise",
            [f"{_ms(f.worst_lag_publishing_s)} / {_ms(f.worst_lag_otherwise_s)}" for f in figures],
        ),
        row(
            "the loop thread's CPU time during the worst lag's interval",
            [f"{_ms(f.worst_lag_loop_cpu_s)} of {_ms(f.worst_lag_interval_s)}" for f in figures],
        ),
        row(
            "the daemon's core: other processes' share; steal; loop thread waiting for it",
            [
                f"{max(f.others_on_core, 0.0):.0%}; {f.steal:.1%}; "
                f"{f.loop_waiting_s:.2f} s of {f.window_s:.0f} s"
                for f in figures
            ],
        ),
        row(
            "worst lag that no garbage collection overlaps",
            [_ms(f.worst_lag_without_gc_s) for f in figures],
        ),
        row(
            "worst lag of an idle loop publishing the batch (after the run)",
            [_ms(f.publish_alone_worst_s) for f in figures],
        ),
        row(
            "longest garbage collection (generation); full ones; objects walked (frozen)",
            [
                f"{_ms(f.gc_worst_s)} ({f.gc_worst_generation}); {f.gc_full}; "
                f"{f.size.run.gc_tracked:,} ({f.size.run.gc_heap.frozen:,})"
                for f in figures
            ],
        ),
        row(
            "full collection after the last batch; references followed (in int lists)",
            [
                f"{_ms(f.size.run.gc_heap.full_collection_s)}; "
                f"{f.size.run.gc_heap.references:,} "
                f"({_share(f.size.run.gc_heap.int_references, f.size.run.gc_heap.references)})"
                for f in figures
            ],
        ),
        row(
            "RSS growth per queued token (first batch)",
            [
                f"**{f.rss_per_token:.1f} B** ({f.size.run.ships[0].queued_tokens / 1e6:.2f}M "
                "tokens queued)"
                for f in figures
            ],
            memory_target,
        ),
        *(
            [
                row(
                    "RSS growth per queued token, marginal between the sizes",
                    [f"{marginal:.1f} B" if i else "" for i in range(len(figures))],
                )
            ]
            if (marginal := _marginal_rss(figures)) is not None
            else []
        ),
        row(
            "queued samples' deep size per token (last batch)",
            [f"**{f.deep_per_token:.1f} B** (arrays {f.array_per_token:.1f} B)" for f in figures],
            memory_target,
        ),
        row(
            "batch write in the run, per M tokens (median)",
            [
                f"**{f.write_s_per_mtok:.3f} s** ({_ms(f.write_s)} a batch, "
                f"{f.write_cpu_share:.0%} of it on CPU)"
                for f in figures
            ],
            f"< {TARGET_WRITE_S_PER_MTOK} s",
        ),
        row(
            "batch write after the run, fsync / none (best)",
            [f"{_ms(f.size.write_fsync.best)} / {_ms(f.size.write_nofsync.best)}" for f in figures],
        ),
        row(
            "batch file",
            [
                f"{statistics.fmean(s.batch_bytes for s in f.size.run.ships) / 2**20:.1f} MiB"
                for f in figures
            ],
        ),
        row(
            "trainer read after the run (`read_batch`, verify), per M tokens (median)",
            [
                f"**{f.read_s_per_mtok:.3f} s** ({_ms(f.read_s)} a batch; first "
                f"{_ms(f.size.read.seconds[0])}, best {_ms(f.size.read.best)})"
                for f in figures
            ],
            f"< {TARGET_READ_S_PER_MTOK} s",
        ),
        row(
            "trainer in the run: batch published to `trained` (median)",
            [
                f"{_ms(f.trainer_in_run_s)} ({f.trainer_in_run_per_mtok:.3f} s per M tokens)"
                for f in figures
            ],
        ),
        row(
            "rollouts/s, first to last batch",
            [
                f"**{f.rollouts_per_s:,.0f}** ({f.tokens_per_s / 1e6:.2f}M tokens/s shipped)"
                for f in figures
            ],
        ),
        row(
            "daemon CPU, first to last batch (event-loop thread)",
            [f"{f.cpu_share:.0%} of a core ({f.loop_cpu_share:.0%})" for f in figures],
        ),
        row("RSS peak", [f"{f.size.run.rss_peak / 2**20:,.0f} MiB" for f in figures]),
        row("wall time of the size", [f"{f.size.wall_s:.0f} s" for f in figures]),
    ]


def _marginal_rss(figures: list[Figures]) -> float | None:
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


def _verdicts(figures: list[Figures]) -> list[str]:
    return [
        f"- {f.size.run.size} samples: worst lag <= {_ms(TARGET_WORST_LAG_S)} "
        f"{_verdict(f.lag_ok)}; <= {TARGET_BYTES_PER_TOKEN:.0f} B RSS per queued token "
        f"{_verdict(f.memory_ok)}; batch write < {TARGET_WRITE_S_PER_MTOK} s per M tokens "
        f"{_verdict(f.write_ok)}; trainer read < {TARGET_READ_S_PER_MTOK} s per M tokens "
        f"{_verdict(f.read_ok)}."
        for f in figures
    ]


def _uncommitted() -> str:
    """ ", with uncommitted changes to ..." when the daemon's code differs from the revision."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "orchestrator", "gc"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent.parent,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    changed = sorted(line[3:] for line in out.splitlines() if line[3:])
    return f", with uncommitted changes to {', '.join(changed)}" if changed else ""


def _conclusions(figures: list[Figures], profiled: SizeResult) -> list[str]:
    """Which targets are met and, for those that are not, where the time (or memory) goes,
    in numbers from this run."""
    targets = {
        f"worst lag <= {_ms(TARGET_WORST_LAG_S)}": [f.lag_ok for f in figures],
        f"<= {TARGET_BYTES_PER_TOKEN:.0f} B RSS per queued token": [f.memory_ok for f in figures],
        f"batch write < {TARGET_WRITE_S_PER_MTOK} s per M tokens": [f.write_ok for f in figures],
        f"trainer read < {TARGET_READ_S_PER_MTOK} s per M tokens": [f.read_ok for f in figures],
    }
    sizes = [f.size.run.size for f in figures]

    def where(oks: list[bool], want: bool) -> str:
        picked = [str(size) for size, ok in zip(sizes, oks, strict=True) if ok == want]
        return "" if len(picked) == len(sizes) else f" (at {' and '.join(picked)} samples)"

    met = [name + where(oks, True) for name, oks in targets.items() if any(oks)]
    missed = [name + where(oks, False) for name, oks in targets.items() if not all(oks)]
    lines = [
        f"**Met:** {'; '.join(met) or 'none'}. **Missed:** {'; '.join(missed) or 'none'}.",
    ]
    f = max(figures, key=lambda fig: fig.size.run.size)
    lines += [
        "",
        f"Throughput ({f.size.run.size} samples): {f.rollouts_per_s:,.0f} rollouts/s, a batch "
        f"every {f.steady_s / max(len(f.size.run.ships) - 1, 1):.1f} s; the daemon's process "
        f"used {f.cpu_share:.0%} of its core meanwhile, so the rate is the fleet's (two "
        "servers and the trainer on one core), not the daemon's.",
    ]
    rows = profiled.loop_profile or []
    busy = sum(own for own, _, name in rows if "epoll" not in name)
    if not all(targets[f"worst lag <= {_ms(TARGET_WORST_LAG_S)}"]):
        lines += ["", _lag_causes(_laggiest(figures), rows, busy)]
    start_up = max(max(fig.size.run.fine_start_up_s, fig.daemon_start_up_s) for fig in figures)
    if start_up > TARGET_WORST_LAG_S:
        lines += [
            "",
            f"Start-up, not counted above: before dispatch starts the loop stalls up to "
            f"{_ms(start_up)} at once (the daemon's own start-up work on its loop, before any "
            "rollout is in flight).",
        ]
    marginal = _marginal_rss(figures)
    if not all(targets[f"<= {TARGET_BYTES_PER_TOKEN:.0f} B RSS per queued token"]):
        lines += [
            "",
            "Memory: the first-batch figure counts everything the daemon allocates until its "
            "first batch whatever the batch's size (connection buffers, replies in flight, "
            "allocator arenas of the worker threads), spread over fewer tokens at the smaller "
            f"size. The queue itself costs {f.deep_per_token:.1f} B per token (deep size; "
            f"{f.array_per_token:.0f} B of it the int32 ids, bool mask and float32 logprobs)"
            + (
                f", and RSS grows by {marginal:.1f} B per additional queued token between the "
                "sizes."
                if marginal is not None
                else "."
            ),
        ]
    largest = max(figures, key=lambda fig: fig.size.run.size).size
    if not all(targets[f"trainer read < {TARGET_READ_S_PER_MTOK} s per M tokens"]):
        detail = largest.read.detail
        profile = largest.read.profile
        full = sum(o for o, _, n in profile if n.startswith("full ("))
        total = max((c for _, c, _ in profile), default=0.0)
        heaviest = ", ".join(f"`{name}` {_share(o, total)}" for o, _, name in profile[:3])
        masks = (
            f"{_share(full, total)} of it is numpy's `full`, allocating every sample's "
            "sampling mask as an int32 [positions, width] array of -1 before the completion "
            f"rows are read in: {detail.get('mask_bytes', 0) / 2**20:,.0f} MiB for the batch, "
            f"of which the completion rows are "
            f"{_share(detail['loss_positions'], detail['positions'])}; the rest is "
            "per-segment Python (paths, segment checks, `pread`). The first read of a process "
            "also pays the page faults on that memory. "
            if total and full / total >= 0.2
            else ""
        )
        lines += [
            "",
            f"Read ({largest.run.size} samples, `read_batch` under cProfile): {masks}"
            f"Most own time: {heaviest}.",
        ]
    if not all(targets[f"batch write < {TARGET_WRITE_S_PER_MTOK} s per M tokens"]):
        top = largest.write_fsync.profile[:3]
        lines += [
            "",
            "Write: in the run the publish shares the daemon's core with the event loop; "
            "after the run it takes "
            f"{_ms(largest.write_fsync.best)} (fsync) / {_ms(largest.write_nofsync.best)} "
            "(none); most own time: " + ", ".join(f"`{name}` {_ms(o)}" for o, _, name in top) + ".",
        ]
    return lines


def _lag_causes(f: Figures, rows: list[tuple[float, float, str]], busy: float) -> str:
    """Why the worst lag misses its target, from this run's figures and the loop profile."""
    run, heap = f.size.run, f.size.run.gc_heap
    steps = [count for _, count, _ in run.long_passes]
    without = f.worst_lag_without_gc_s
    int_share = heap.int_references / heap.references if heap.references else 0.0
    collection = (
        f"A full garbage collection stops the loop for {_ms(f.gc_worst_s)} ({f.gc_full} in "
        f"this run; {heap.frozen:,} objects frozen out of it): it follows "
        f"{heap.references:,} references from {heap.tracked:,} objects"
        + (
            f", {int_share:.0%} of them the items of {heap.int_sequences} lists and tuples of "
            f"at least {INT_RUN:,} Python ints (token ids held as Python objects, such as a "
            "request body's `token_ids` while the request is in flight)"
            if int_share >= 0.1
            else ""
        )
        + f"; a full collection just after the last batch took "
        f"{_ms(heap.full_collection_s)}. "
    )
    if f.gc_worst_s <= TARGET_WORST_LAG_S:
        collection = (
            f"Garbage collection is not it (the longest took {_ms(f.gc_worst_s)}, "
            f"{heap.frozen:,} objects frozen out of it). "
        )
    skip = ("run_daemon", "_run_member ", "_run_rollout ", "serve (", "_run_group ", "<")
    ours = [
        (cumulative, name)
        for _, cumulative, name in sorted(rows, key=lambda r: -r[1])
        if "orchestrator/" in name and not any(word in name for word in skip)
    ]
    heaviest = [(o, n) for o, _, n in rows if "epoll" not in n][:3]
    ran = f.worst_lag_loop_cpu_s / f.worst_lag_interval_s if f.worst_lag_interval_s else 1.0
    waiting = (
        f"The worst stall ({_ms(f.worst_lag_s)}) is not the loop's own work: its thread was "
        f"on a CPU for {_ms(f.worst_lag_loop_cpu_s)} of the {_ms(f.worst_lag_interval_s)} "
        "between that wake-up and the one before, and waited the rest for the core (or for "
        "the interpreter lock, held by a worker thread). Other processes had the daemon's "
        f"core {max(f.others_on_core, 0.0):.0%} of the run (the machine is shared; load "
        f"average {os.getloadavg()[0]:.1f} as this was written), the hypervisor took "
        f"{f.steal:.1%} of it, and the loop thread waited {f.loop_waiting_s:.2f} s for a CPU "
        "in all; the daemon's own worker threads (payload deletions, file checks, publishes, "
        "progress saves) run on the same core. "
        if ran < 0.5
        else ""
    )
    return (
        f"Lag ({run.size} samples). {collection}{waiting}Leaving out the stalls a collection "
        "overlaps, "
        f"the worst lag is {_ms(without)}"
        + (" (within the target)" if without <= TARGET_WORST_LAG_S else "")
        + ": passes of the event loop in which many rollout steps run back to back (median "
        f"{statistics.median(steps or [0]):.0f} task steps in the passes over 10 ms), each a "
        "fraction of a millisecond to a few of Python. The loop thread's busy time (cProfile, "
        "below; cumulative, nested calls included) goes to "
        + ", ".join(f"`{name.split(' (')[0]}` {_share(c, busy)}" for c, name in ours[:6])
        + "; the most own time: "
        + ", ".join(f"`{name}` {_share(o, busy)}" for o, name in heaviest)
        + ". A batch publish overlapping a busy pass stretches it (the worker thread shares "
        "the daemon's core and interpreter lock), though alone it lags an idle loop by "
        f"{_ms(f.publish_alone_worst_s)}."
    )


def _gc_within(collections: list[tuple[int, float, float]], start: float, end: float) -> float:
    """Seconds of garbage collection between `start` and `end` (perf_counter)."""
    return sum(
        min(end, at + seconds) - max(start, at)
        for _, seconds, at in collections
        if at < end and at + seconds > start
    )


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "-"


def _laggiest(figures: list[Figures]) -> Figures:
    """The size whose worst lag (either monitor) is the worst."""
    return max(figures, key=lambda f: max(f.worst_lag_s, f.daemon_worst_s))


def _lag_analysis(figures: list[Figures], profiled: SizeResult) -> list[str]:
    """Where the event loop's time goes: the long passes by task, and the loop thread's
    cProfile (an unreported run)."""
    f = _laggiest(figures)
    run = f.size.run
    lines = [
        f"Where the lag comes from ({run.size} samples). Trio runs every runnable task once "
        "per pass of its loop and looks at timers (the lag monitor's wake-up) only between "
        "passes, so a pass's length is the lag it causes. Worst lag while a batch was being "
        f"published {_ms(f.worst_lag_publishing_s)}, otherwise {_ms(f.worst_lag_otherwise_s)}; "
        "publishing the same batch from a worker thread into an otherwise idle loop (after "
        f"the run) lagged it by {_ms(f.publish_alone_worst_s)} at worst; the longest garbage "
        f"collection took {_ms(f.gc_worst_s)} (generation {f.gc_worst_generation}).",
    ]
    total = sum(run.long_pass_time.values())
    if run.long_passes:
        lengths = [length for length, _, _ in run.long_passes]
        steps = [count for _, count, _ in run.long_passes]
        lines += [
            "",
            f"{len(lengths)} pass{'es' if len(lengths) != 1 else ''} took over 10 ms "
            f"(longest {_ms(max(lengths))}, median "
            f"{statistics.median(steps):.0f} task steps each, {_ms(sum(lengths))} in all); "
            "their task steps' time by task (a trio instrument in the measured run):",
            "",
            "| task | share | steps | per step |",
            "|---|---:|---:|---:|",
            *(
                f"| `{name}` | {_share(seconds, total)} | {run.long_pass_steps[name]:,} | "
                f"{_ms(seconds / max(run.long_pass_steps[name], 1))} |"
                for name, seconds in sorted(run.long_pass_time.items(), key=lambda kv: -kv[1])[
                    :TOP_FUNCTIONS
                ]
            ),
        ]
    if run.long_steps:
        lines += [
            "",
            "Longest single task steps (where the task suspended after; garbage collection "
            "within the step):",
            "",
            "| step | task | suspended at | collection in it |",
            "|---:|---|---|---:|",
            *(
                f"| {_ms(seconds)} | `{name}` | `{where}` | "
                f"{_ms(_gc_within(run.gc_collections, start, start + seconds))} |"
                for seconds, name, where, start in run.long_steps[:5]
            ),
        ]
    rows = profiled.loop_profile or []
    idle = sum(own for own, _, name in rows if "epoll" in name)
    busy = sum(own for own, _, _ in rows) - idle
    ours = [row for row in sorted(rows, key=lambda r: -r[1]) if "orchestrator/" in row[2]]
    # Entry points and the dispatcher's own loops say nothing about what costs.
    skip = ("run_daemon", "_run_member ", "_run_rollout ", "serve (", "_run_group ")
    ours = [row for row in ours if not any(word in row[2] for word in skip)]
    lines += [
        "",
        f"The event loop's thread under cProfile (an unreported run of {profiled.run.size} "
        f"samples, {profiled.run.steps} batches; the profiler slows it down, read the shares): "
        f"{busy:.1f} s busy of {profiled.loop_profile_s:.1f} s. The daemon's functions by "
        "cumulative time, as a share of the busy time:",
        "",
        "| cumulative | share | function |",
        "|---:|---:|---|",
        *(
            f"| {cumulative:.2f} s | {_share(cumulative, busy)} | `{name}` |"
            for _, cumulative, name in ours[:12]
        ),
        "",
        "Top functions by own time:",
        "",
        "| own | share | function |",
        "|---:|---:|---|",
        *(
            f"| {own:.2f} s | {_share(own, busy)} | `{name}` |"
            for own, _, name in rows[: TOP_FUNCTIONS + 1]
            if "epoll" not in name
        ),
    ]
    return lines


def report(
    results: list[SizeResult],
    profiled: SizeResult,
    args: argparse.Namespace,
    cores: str,
    command: str,
) -> str:
    figures = [Figures.of(result) for result in results]
    largest = max(results, key=lambda r: r.run.size)
    read = largest.read.detail
    discards = "; ".join(
        f"{r.run.size}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r.run.discards.items()) if v)
        for r in results
    )
    return "\n".join(
        [
            "## System: real scale, a million tokens a step and more (`bench/system_scale.py`)",
            "",
            f"`{command.strip()}` (revision {git_revision()}{_uncommitted()}), on {machine()}.",
            "",
            f'Single-turn "math" rollouts of ~4,500 tokens (prompts of {PROMPT_MIN:,}..'
            f"{PROMPT_MAX:,} tokens, max_tokens {MAX_TOKENS}: ~505 completion tokens on "
            f"average), groups of {GROUP_SIZE}, batches of "
            f"{' and '.join(str(s) for s in args.sizes)} samples, {args.steps} batches per "
            f"size, max_inflight {MAX_INFLIGHT}, max_off_policy_steps 2, max_async_steps 1, "
            f"payloads by handle, a payload-light model ({SHAPE.layers} layer, top-"
            f"{SHAPE.top_k} of {SHAPE.num_experts} experts: the disk is not what is measured), "
            "the trainer's train time 0. Each size runs in a fresh process: the daemon in it "
            "with its metrics endpoint on (so its own lag monitor runs, 50 ms wake-ups) and the "
            "same monitor run by the benchmark with 1 ms wake-ups (every wake-up kept); "
            f"{SERVERS} `orchestrator sim-inference` processes and `orchestrator sim-trainer` "
            f"as separate processes. Cores: {cores}. Lag covers dispatch start to the last "
            "shipped batch. RSS growth: VmRSS just before the first batch is assembled minus "
            "VmRSS when dispatching starts, over the tokens then queued; deep size: the sink's "
            "`QueuedSample`s with everything they reach, just before the last batch. Batch "
            "write: `publish_batch` (encode, write, fsync, rename) timed in the daemon's worker "
            "thread; after the run, the last batch's samples are published again with the "
            f"fleet stopped ({REPEATS} times). The trainer stops one batch short, so the last "
            "batch stays on disk with its payload files, and `read_batch(verify=True)` is "
            f"timed on it after the run ({REPEATS} times). Discarded units: {discards}.",
            "",
            *_table(figures),
            "",
            *_verdicts(figures),
            "",
            *_conclusions(figures, profiled),
            "",
            *_lag_analysis(figures, profiled),
            "",
            f"The trainer's read of the {largest.run.size}-sample batch: "
            f"{read.get('positions', 0) / 1e6:.2f}M positions, of which "
            f"{read.get('loss_positions', 0) / 1e6:.2f}M completion tokens; the sampling masks "
            f"come back as int32 [positions, {read.get('mask_width', 0):.0f}] arrays padded "
            f"with -1, {read.get('mask_bytes', 0) / 2**20:,.0f} MiB for the batch, routing "
            f"{read.get('routing_bytes', 0) / 2**20:,.0f} MiB.",
            "",
            *_profile_table(
                f"Trainer read, {largest.run.size} samples (`read_batch`, verify)", largest.read
            ),
            *_profile_table(
                f"Batch write, {largest.run.size} samples, fsync as the daemon does",
                largest.write_fsync,
            ),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument(
        "--steps", type=int, default=5, help="batches per size (the trainer reads all but one)"
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument(
        "--no-pass-timer",
        dest="time_passes",
        action="store_false",
        help="do not time the event loop's passes by task (a trio instrument)",
    )
    # Internal: measure one size in this process and pickle the result to --out.
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("need --steps >= 2 (the first batch is the warm-up)")
    cores = plan_cores()
    if args.worker is not None:
        pin_self(cores.daemon)
        quiet_daemon_logs()
        result = measure_size(
            args.worker,
            args.steps,
            args.dir,
            cores,
            time_passes=args.time_passes,
            profile_loop=args.profile_loop,
        )
        args.out.write_bytes(pickle.dumps(result))
        return 0
    pin_self(frozenset())  # not pinned: only SIGTERM made to unwind, stopping the workers
    command = "uv run --frozen --group bench python bench/system_scale.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="system-scale-", dir=args.dir) as tmp:
        # Each size in a fresh process: RSS growth is measured from a heap that has not
        # held a batch before.
        results = []
        for size in args.sizes:
            print(f"{stamp()} batches of {size}: {args.steps} steps", flush=True)
            extra = [] if args.time_passes else ["--no-pass-timer"]
            results.append(_in_worker(size, args.steps, Path(tmp) / f"size-{size}", extra))
        # One more, unreported run of the largest size with the event loop's thread under
        # cProfile, whose overhead would distort the figures above.
        largest = max(args.sizes)
        print(f"{stamp()} batches of {largest} under cProfile: {PROFILE_STEPS} steps", flush=True)
        profiled = _in_worker(
            largest, PROFILE_STEPS, Path(tmp) / "profiled", ["--profile-loop", "--no-pass-timer"]
        )
    markdown = report(results, profiled, args, cores.describe(), command)
    print(markdown)
    if not args.no_write:
        write_section("system_scale", markdown)
    return 0


def _in_worker(size: int, steps: int, base: Path, extra: list[str]) -> SizeResult:
    """`measure_size` in a fresh process (this script with --worker)."""
    out = base.with_suffix(".pickle")
    command = [sys.executable, __file__, "--worker", str(size), "--out", str(out)]
    command += ["--steps", str(steps), "--dir", str(base), *extra]
    worker = subprocess.Popen(command)
    try:
        returncode = worker.wait()
    except BaseException:
        # Stopped (Ctrl-C, SIGTERM): the worker stops its fleet on SIGTERM.
        worker.terminate()
        worker.wait(timeout=60)
        raise
    if returncode != 0:
        raise RuntimeError(f"system_scale: the worker for {size} samples failed ({returncode})")
    result: SizeResult = pickle.loads(out.read_bytes())
    return result


if __name__ == "__main__":
    sys.exit(main())
