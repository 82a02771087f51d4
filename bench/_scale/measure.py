"""One measured run of one batch size: the daemon in this process, the fleet in others,
then the timings after the run."""

from __future__ import annotations

import contextlib
import cProfile
import functools
import os
import time
from collections import Counter
from pathlib import Path

import attrs
import trio
from system_fleet import (
    CorePlan,
    demo_config,
    rss_bytes,
    run_overrides,
    running_daemon,
    sim_servers,
    sim_trainer,
    stamp,
)

from _scale.after_run import (
    QueueCost,
    Timed,
    publish_alone_lags,
    queue_cost,
    time_read,
    time_write,
    trainer_reads,
)
from _scale.probe import Probe, Ship, instrumented
from _scale.profiles import profile_rows
from _scale.recorders import AllLags, CpuSnapshot, GcHeap, GcTimes, LoopPasses, gc_heap
from _scale.workload import (
    FINE_LAG_INTERVAL_S,
    POLL_S,
    SERVERS,
    SHAPE,
    TRAINER_GRACE_S,
    workload_overrides,
)
from orchestrator.daemon.metrics import serve_loop_lag_monitor
from orchestrator.handoff import batch_step_dir


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
            probe.completed = lambda: state.dispatch.rollouts["completed"]
            with contextlib.ExitStack() as stack:
                gc_times = stack.enter_context(GcTimes().installed())
                if time_passes:
                    trio.lowlevel.add_instrument(passes)
                    stack.callback(trio.lowlevel.remove_instrument, passes)
                rss_start, started = rss_bytes(), time.perf_counter()
                cpu_start = CpuSnapshot.now(core)
                rss_peak = rss_start
                reported = 0
                while state.shipping.next_step <= probe.last_step:
                    if run.outcome is not None:
                        raise RuntimeError("system_scale: the run ended before its last batch")
                    await trio.sleep(POLL_S)
                    rss_peak = max(rss_peak, rss_bytes())
                    if state.shipping.next_step - 1 > reported:
                        reported = state.shipping.next_step - 1
                        print(
                            f"{stamp()}   batch {reported} of {size} shipped: "
                            f"{state.dispatch.rollouts['completed']:,} rollouts completed, "
                            f"RSS {rss_bytes() / 2**20:.0f} MiB",
                            flush=True,
                        )
                # The last batch's publish has returned (next_step moves after it).
                end = time.perf_counter()
                cpu = CpuSnapshot.now(core) - cpu_start
                gc_collections = list(gc_times.collections)
            daemon_lags = [w for stats in probe.daemon_loop_stats for w in stats.wakeups]
            rollouts = dict(state.dispatch.rollouts)
            discards = dict(probe.sink.counters) if probe.sink is not None else {}
            # Outside the window the figures cover: what a full collection walks.
            heap = gc_heap()
            # Let the trainer log its last step (it stops one short of the daemon's).
            with trio.move_on_after(TRAINER_GRACE_S):
                while state.versions.applied < probe.last_step - 1:
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
        loop_profile=None if profile is None else profile_rows(profile),
        loop_profile_s=profiled_s,
    )
    probe.last_queue.clear()
    probe.last_samples.clear()
    return result
