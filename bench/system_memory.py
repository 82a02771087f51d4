"""Memory soak: the daemon's RSS over a long by-handle run, sampled at every shipped batch.

The demo's workload (the "mixed" environment: single-turn and 3-turn rollouts, batches of
16 in groups of 4, max_off_policy_steps 2, max_async_steps 1, payloads by handle) for
1,000 steps, with what does not matter for memory shrunk so it runs in minutes: the
trainer trains in zero time, the model is 4 layers top-8 of 128 experts (the payload
*files* are smaller; the daemon only ever holds their names and segments), prompts are
16..64 tokens and turns 16 tokens. The daemon runs in this process (its RSS is this
process's VmRSS); the servers and the trainer are separate processes.

At every shipped batch it records VmRSS and the sink's payload references (files held by
queued samples, files pinned by shipped samples not yet collected). Growth is the
least-squares slope of RSS over steps after the warm-up, per 100 steps; the bytes per
tracked file are the deep size of the reference table divided by the files it tracks.

    uv run --frozen --group bench python bench/system_memory.py [--steps N] [--warm-up N]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import attrs
import trio
from _deep_size import deep_size
from _report import git_revision, machine, write_section
from system_fleet import (
    ModelShape,
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

from orchestrator.core.sink import TrainSink
from orchestrator.daemon.run import RunOutcome
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.services import Services

TARGET_GROWTH_PER_100_STEPS = 1_000_000
SHAPE = ModelShape(layers=4, top_k=8, num_experts=128)
TRACE_SITES = 12
# Allocator settings that change what RSS measures; a run under them is labelled so.
ALLOCATOR_VARIABLES = ("PYTHONMALLOC", "MALLOC_ARENA_MAX")


@attrs.frozen
class StepSample:
    step: int
    seconds: float
    rss: int
    held_files: int
    pinned_files: int
    refs_bytes: int  # deep size of the sink's reference table

    @property
    def tracked_files(self) -> int:
        return self.held_files + self.pinned_files


def workload_overrides(steps: int) -> list[str]:
    return [
        f"max_steps={steps}",
        'payload.mode="by_handle"',
        "sim.train_time_s=0.0",
        "trainer.poll_interval_s=0.05",
        "sim.prompt_len_min=16",
        "sim.prompt_len_max=64",
        "sim.max_tokens=16",
    ]


def find_sink(state: RunState) -> TrainSink:
    """The run's sink, found through the daemon's services that hold `state`.

    `run_daemon` hands out only the `RunState`; the sink is reachable from the `Services`
    that refer to the same state, so the garbage collector's referrer list finds it
    (a benchmark-only shortcut, run once). The daemon freezes its start-up objects, the
    `Services` among them, where `get_referrers` does not look: they are unfrozen for the
    search and frozen again.
    """
    gc.unfreeze()
    try:
        for referrer in gc.get_referrers(state):
            if isinstance(referrer, Services):
                return referrer.sink
    finally:
        gc.freeze()
    raise RuntimeError("system_memory: no Services refer to the run state")


def _where(traceback: tracemalloc.Traceback) -> str:
    """The allocating line and, up the stack, the first line in the daemon's own code
    (what to change), relative to `orchestrator/`: e.g.
    `pathlib.py:71 <- core/payload_refs.py:31`."""
    frames = list(traceback)  # most recent call first
    where = f"{Path(frames[0].filename).name}:{frames[0].lineno}"
    for frame in frames[1:]:
        if "/orchestrator/" in frame.filename and "/orchestrator/" not in frames[0].filename:
            return f"{where} <- {frame.filename.split('/orchestrator/')[-1]}:{frame.lineno}"
    return where


@attrs.frozen
class Growth:
    """Where Python memory grew between the end of the warm-up and the last step."""

    from_step: int
    to_step: int
    total: int
    sites: list[tuple[int, int, str]]  # (bytes, blocks, "file:line")


async def _soak(
    overrides: list[str], progress_every: int, trace_from: int | None
) -> tuple[list[StepSample], RunOutcome, Growth | None]:
    config = demo_config(overrides)
    samples: list[StepSample] = []
    started = time.perf_counter()
    async with running_daemon(config) as run:
        state = run.state
        sink = find_sink(state)
        shipped = state.shipping.next_step - 1
        baseline: tracemalloc.Snapshot | None = None
        while run.outcome is None:
            await state.wait_changed()
            if state.shipping.next_step - 1 == shipped:
                continue
            shipped = state.shipping.next_step - 1
            if trace_from is not None and shipped == trace_from:
                baseline = _snapshot()
            refs = sink.refs
            samples.append(
                StepSample(
                    step=shipped,
                    seconds=time.perf_counter() - started,
                    rss=rss_bytes(),
                    held_files=refs.held_files,
                    pinned_files=refs.pinned_files,
                    refs_bytes=deep_size(refs),
                )
            )
            if shipped % progress_every == 0:
                last = samples[-1]
                print(
                    f"{stamp()} step {shipped}: RSS {last.rss / 2**20:.1f} MiB, tracked files "
                    f"{last.held_files} held + {last.pinned_files} pinned",
                    flush=True,
                )
    growth = None
    if baseline is not None:
        growth = _growth(baseline, _snapshot(), trace_from or 0, shipped)
    assert run.outcome is not None
    return samples, run.outcome, growth


def _snapshot() -> tracemalloc.Snapshot:
    # Cyclic garbage waiting for a full collection is not growth: collect it first.
    gc.collect()
    # Only the daemon's allocations matter; tracemalloc's own and the import machinery's
    # are noise.
    return tracemalloc.take_snapshot().filter_traces(
        [
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
        ]
    )


def _growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, a: int, b: int) -> Growth:
    diffs = after.compare_to(before, "traceback")
    sites = [(d.size_diff, d.count_diff, _where(d.traceback)) for d in diffs[:TRACE_SITES]]
    return Growth(a, b, sum(d.size_diff for d in diffs), sites)


def slope_per_step(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mean_x) ** 2 for x in xs)
    return num / den


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warm-up", type=int, default=100, help="steps not judged")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also trace Python allocations (slower; RSS then includes the tracing) and "
        "report the sites that grew between the warm-up and the last step",
    )
    parser.add_argument(
        "--trace-depth",
        type=int,
        default=1,
        help="frames kept per traced allocation; more names the callers but is much slower",
    )
    args = parser.parse_args()
    if args.steps < args.warm_up + 10:
        parser.error("need --steps >= --warm-up + 10")
    cores = plan_cores()
    pin_self(cores.daemon)
    quiet_daemon_logs()
    environment = "".join(
        f"{variable}={os.environ[variable]} "
        for variable in ALLOCATOR_VARIABLES
        if os.environ.get(variable)
    )
    command = (
        f"{environment}uv run --frozen --group bench python bench/system_memory.py "
        + " ".join(sys.argv[1:])
    )
    with tempfile.TemporaryDirectory(prefix="system-memory-", dir=args.dir) as tmp:
        base = Path(tmp)
        with sim_servers(2, SHAPE, cores.fleet) as urls:
            overrides = run_overrides(base / "run", urls, SHAPE, workload_overrides(args.steps))
            with sim_trainer(overrides, cores.fleet, base / "trainer.log"):
                if args.tracemalloc:
                    tracemalloc.start(args.trace_depth)
                trace_from = args.warm_up if args.tracemalloc else None
                samples, outcome, growth = trio.run(
                    _soak, overrides, max(args.steps // 20, 1), trace_from
                )
    markdown = report(samples, outcome, args, cores.describe(), command, growth)
    print(markdown)
    # Diagnostic runs (traced, or under another allocator set-up from the environment) go
    # beside the plain soak, not over it.
    section = "system_memory_traced" if args.tracemalloc else "system_memory"
    for variable in ALLOCATOR_VARIABLES:
        if os.environ.get(variable):
            section += f"_{variable.lower()}_{os.environ[variable]}"
    write_section(section, markdown)
    return 0


def report(
    samples: list[StepSample],
    outcome: RunOutcome,
    args: argparse.Namespace,
    cores: str,
    command: str,
    traced_growth: Growth | None,
) -> str:
    steady = [s for s in samples if s.step > args.warm_up]
    slope = slope_per_step([s.step for s in steady], [s.rss for s in steady])
    per_100_steps = 100 * slope
    rss_min, rss_max = min(s.rss for s in steady), max(s.rss for s in steady)
    first, last = steady[0], steady[-1]
    tracked = [s.tracked_files for s in steady]
    per_file = [s.refs_bytes / s.tracked_files for s in steady if s.tracked_files]
    state = outcome.state
    verdict = "met" if per_100_steps < TARGET_GROWTH_PER_100_STEPS else "MISSED"
    checkpoints = [s for s in samples if s.step in _checkpoints(args.steps)]
    traced: list[str] = []
    if traced_growth is not None:
        traced = [
            "",
            f"Python allocations (tracemalloc) that grew from step "
            f"{traced_growth.from_step} to {traced_growth.to_step}, "
            f"{traced_growth.total / 1e3:+,.0f} kB in all (RSS above includes tracemalloc's "
            "own overhead in this mode):",
            "",
            "| grew by | blocks | allocated at |",
            "|---:|---:|---|",
            *(
                f"| {size / 1e3:+,.1f} kB | {count:+,} | `{site}` |"
                for size, count, site in traced_growth.sites
            ),
        ]
    rows = [
        "| step | RSS | files held | files pinned | reference table |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {s.step} | {s.rss / 2**20:.1f} MiB | {s.held_files} | {s.pinned_files} | "
            f"{s.refs_bytes / 1024:.0f} KiB |"
            for s in checkpoints
        ),
    ]
    return "\n".join(
        [
            "## System: memory soak (`bench/system_memory.py`)"
            + (", allocations traced" if traced_growth is not None else "")
            + "".join(
                f", {variable}={os.environ[variable]}"
                for variable in ALLOCATOR_VARIABLES
                if os.environ.get(variable)
            ),
            "",
            f"`{command.strip()}` (revision {git_revision()}), on {machine()}.",
            "",
            f"{len(samples)} steps of the demo's workload by handle (mixed single- and "
            "3-turn rollouts, batches of 16 in groups of 4, max_off_policy_steps 2, "
            "max_async_steps 1) with the trainer's train time set to 0 and what does not "
            f"matter for memory shrunk: model {SHAPE.layers} layers top-{SHAPE.top_k} of "
            f"{SHAPE.num_experts}, prompts 16..64 tokens, 16 tokens per turn. The daemon runs "
            "in the benchmark's process, whose VmRSS is sampled at every shipped batch; "
            f"2 servers and the trainer are separate processes. Cores: {cores}. "
            f"{state.dispatch.rollouts['completed']:,} rollouts completed, "
            f"{sum(state.payload.files_deleted.values()):,} payload files deleted, "
            f"in {samples[-1].seconds:.0f} s.",
            "",
            *rows,
            "",
            f"- After a warm-up of {args.warm_up} steps: RSS grows by "
            f"**{per_100_steps / 1e3:+,.1f} kB per 100 steps** (least-squares slope over steps "
            f"{first.step}..{last.step}; target < {TARGET_GROWTH_PER_100_STEPS / 1e6:.0f} MB: "
            f"{verdict}); min {rss_min / 2**20:.1f} MiB, max {rss_max / 2**20:.1f} MiB, "
            f"first {first.rss / 2**20:.1f} MiB, last {last.rss / 2**20:.1f} MiB.",
            f"- Tracked payload files (held + pinned) after the warm-up: mean "
            f"{statistics.fmean(tracked):,.0f}, max {max(tracked):,}, last {last.tracked_files:,}: "
            "bounded, since pins are dropped when the collector removes their version.",
            f"- The sink's reference table costs **{statistics.fmean(per_file):,.0f} bytes per "
            f"tracked file** (deep size / files tracked, mean over the steady steps; the path "
            f"strings included), i.e. {statistics.fmean(per_file) * 1e6 / 2**20:,.0f} MiB per "
            "million tracked files.",
            *traced,
        ]
    )


def _checkpoints(steps: int) -> set[int]:
    return {1, 10, *range(100, steps + 1, max(steps // 10, 1)), steps}


if __name__ == "__main__":
    sys.exit(main())
