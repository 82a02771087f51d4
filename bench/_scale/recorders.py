"""What the benchmark records in the daemon's process while it runs: every event-loop
wake-up, every garbage collection, the loop's long passes by task, who had the daemon's
core, and what a full collection walks."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio
from system_fleet import cpu_seconds

from _scale.profiles import function_name
from _scale.workload import LONG_STEP_S
from orchestrator.daemon.metrics import LoopStats


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
        function_name(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
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
