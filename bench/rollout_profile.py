"""Where a real rollout's cost goes on the daemon's side: microseconds of daemon CPU per
rollout, stage by stage, for this checkout and an older revision side by side.

Each workload is one of bench/real_tasks.py's (the same fleet and trainer on one core, the
daemon in a process of this script on the other), run twice per revision in a fresh
process: once plain, for the figures (rollouts, the process's CPU and the event loop
thread's), and once under cProfile timed by the loop thread's own CPU clock
(`time.thread_time`: a core taken away by another process is not counted), over the
measured span only (first dispatch to the end). The profile gives each stage's share of
the loop thread's time (STAGES: task roots and the functions nested in them, disjoint, so
the rows add up), scaled to the plain run's loop CPU; "trio's scheduler, I/O and the rest"
is what no stage holds, "the daemon's worker threads" the process's CPU less the loop
thread's. The older revision runs from a git worktree with this checkout's virtual
environment and benchmark scripts (bench/_old_tree.py); a stage whose functions it lacks
reads 0 there and its time falls into the rest.

    uv run --frozen --group bench python bench/rollout_profile.py [--kinds KIND ...]
        [--steps N] [--batch-size N] [--top N] [--old REV] [--no-write]

`--batch-size` runs the workloads at that many rollouts per step instead of the demo's 16
(work done once per step, the weight updates, collection and shipping, is then shared by
that many rollouts, as in a production run) and writes its own section.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import real_tasks
import trio
from _old_tree import old_tree, python_path, resolve
from _report import git_revision, machine, write_section
from startup_time import DEFAULT_OLD
from system_fleet import pin_self, plan_cores, quiet_daemon_logs

converter = cattrs.Converter()

#: A function in the profile: (the end of its file's path, its name).
Function = tuple[str, str]


@attrs.frozen
class Stage:
    """A stage's time: the inclusive time of `functions` less that of `minus` (the stages
    nested in them). Every stage's functions are task roots (called by trio's
    `Context.run`) or nested in one, and no two stages overlap."""

    name: str
    functions: frozenset[Function]
    minus: frozenset[Function] = frozenset()


def _stage(name: str, *functions: str, minus: tuple[Stage, ...] = ()) -> Stage:
    def parse(entry: str) -> Function:
        path, _, function = entry.partition(":")
        return (path, function)

    nested = frozenset(f for stage in minus for f in stage.functions)
    return Stage(name, frozenset(map(parse, functions)), nested)


PROMPT = _stage("prompt: chat template and tokens", "dataset_env.py:prompt", "plugin_env.py:prompt")
HTTP = _stage("request, send and receive (HTTP/1.1)", "inference/client.py:post_generate")
PARSE = _stage(
    "reply: parse, logprobs, segment checks",
    "wire/generate.py:parse_generate_response",
    # A group's reply (2afb157 on): its choices split, then each parsed.
    "wire/generate.py:reply_choices",
    "wire/generate.py:parse_choice",
)
# A stage names its functions as every compared revision has them (the finisher was the
# dispatcher's until 27e6282).
FILES = _stage(
    "payload files checked on disk",
    "daemon/rollout_finisher.py:check_files",
    "daemon/dispatcher.py:_check_files",
)
REWARD = _stage("reward: round trip to the worker", "tasks/reward_pool.py:score")
SAMPLE = _stage("sample build (stitch, arrays)", "core/samples.py:build_sample")
NESTED = (PROMPT, HTTP, PARSE, FILES, REWARD, SAMPLE)
STAGES: tuple[Stage, ...] = (
    *NESTED,
    _stage(
        "dispatch, turns and tallies (the rest)",
        "daemon/dispatcher.py:serve",
        "daemon/dispatcher.py:_run_group",
        "daemon/dispatcher.py:_run_member",
        "daemon/rollout_runner.py:_run_into",
        "daemon/rollout_finisher.py:finish",
        "daemon/dispatcher.py:finish",
        minus=NESTED,
    ),
    _stage("batches: sink and shipping", "daemon/admission.py:serve", "daemon/shipper.py:serve"),
    _stage(
        "weight updates and collection",
        "daemon/policy.py:serve",
        "daemon/policy.py:update",
        "daemon/policy.py:_watch",
        "payload_gc/_collect.py:remove",
    ),
)
#: The benchmark's own tasks, left out of the daemon's time.
BENCH = _stage("the benchmark's own", "real_tasks.py:lag_monitor", "real_tasks.py:measure")
SCHEDULER = "trio's scheduler, I/O and the rest"
THREADS = "the daemon's worker threads"

KINDS = ("tasks-demo", "tasks-long", "toy-demo", "toy-long")


@attrs.frozen
class Breakdown:
    """One run's cost per rollout: the unprofiled figures and the profile's stage shares
    scaled to them."""

    kind: str
    rollouts: int
    daemon_cpu_s: float
    loop_cpu_s: float
    #: stage name -> microseconds per rollout, every row of the table.
    stages: dict[str, float]
    top: list[tuple[str, float]]
    #: The worker threads' jobs by function, microseconds per rollout, heaviest first.
    thread_jobs: list[tuple[str, float]]

    @property
    def per_cpu_s(self) -> float:
        return self.rollouts / self.daemon_cpu_s


def inclusive(stats: pstats.Stats, functions: frozenset[Function]) -> float:
    """The time in `functions` and what they call, each second once: a matching function
    called by another (a task's local function calling a method of the same name) is
    counted in its caller's time, not again."""
    raw = stats.stats  # type: ignore[attr-defined]

    def matches(key: tuple[str, int, str]) -> bool:
        filename, _line, function = key
        return any(filename.endswith(path) and function == name for path, name in functions)

    total = 0.0
    for key, (_cc, _nc, _tt, ct, callers) in raw.items():
        if matches(key):
            nested = sum(edge[3] for caller, edge in callers.items() if matches(caller))
            total += ct - nested
    return total


def breakdown(
    kind: str,
    plain: real_tasks.Result,
    stats: pstats.Stats,
    top: int,
    jobs: Mapping[str, float],
) -> Breakdown:
    """`stats`' shares of the loop thread's time, scaled to the unprofiled run `plain`."""
    bench = inclusive(stats, BENCH.functions)
    total = float(stats.total_tt) - bench  # type: ignore[attr-defined]
    loop_us = (plain.loop_cpu_s / plain.rollouts) * 1e6
    # The unprofiled loop time has the benchmark's lag monitor in it too: take its share out.
    loop_us *= total / (total + bench)
    stages = {}
    for stage in STAGES:
        seconds = inclusive(stats, stage.functions) - inclusive(stats, stage.minus)
        stages[stage.name] = loop_us * seconds / total
    stages[SCHEDULER] = loop_us - sum(stages.values())
    stages[THREADS] = (plain.daemon_cpu_s - plain.loop_cpu_s) / plain.rollouts * 1e6
    per_job = {name: seconds / plain.rollouts * 1e6 for name, seconds in jobs.items()}
    return Breakdown(
        kind,
        plain.rollouts,
        plain.daemon_cpu_s,
        plain.loop_cpu_s,
        stages,
        [(name, loop_us * tt / total) for name, tt in top_functions(stats, top)],
        sorted(per_job.items(), key=lambda item: -item[1]),
    )


def top_functions(stats: pstats.Stats, count: int) -> list[tuple[str, float]]:
    """The `count` functions with the most time of their own (seconds)."""
    raw = stats.stats  # type: ignore[attr-defined]
    rows = sorted(raw.items(), key=lambda item: -item[1][2])[:count]
    return [
        (f"{_short(filename)}:{function}", tt)
        for (filename, _line, function), (_cc, _nc, tt, _ct, _callers) in rows
    ]


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/orchestrator/", "/payload-gc/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def _job_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module.rpartition('.')[2]}.{name}".replace(".<locals>", "")


@attrs.define
class ThreadJobTimes:
    """Every `trio.to_thread.run_sync` job's CPU time (its thread's clock) while enabled,
    by the job function's name: the daemon's worker threads, job by job, at the cost of
    two clock reads per job. A `real_tasks.Span`; `installed()` patches trio meanwhile."""

    seconds: dict[str, float] = attrs.field(factory=dict)
    _on: bool = False
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def enable(self) -> None:
        self._on = True

    def disable(self) -> None:
        self._on = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        real = trio.to_thread.run_sync

        async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not self._on:
                return await real(fn, *args, **kwargs)
            name = _job_name(fn)

            def timed(*inner: Any) -> Any:
                start = time.thread_time()
                try:
                    return fn(*inner)
                finally:
                    spent = time.thread_time() - start
                    with self._lock:
                        self.seconds[name] = self.seconds.get(name, 0.0) + spent

            return await real(timed, *args, **kwargs)

        trio.to_thread.run_sync = run_sync  # type: ignore[assignment]
        try:
            yield
        finally:
            trio.to_thread.run_sync = real


def measure_kind(kind: str, steps: int, top: int, batch_size: int | None) -> Breakdown:
    """Two runs of `kind`: one plain, for the figures and the thread jobs, and one profiled,
    for the loop thread's shares."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        if kind == "tasks-long":
            real_tasks.long_dataset(base / "long.jsonl", rows=200, words=2600)
        for run in ("plain", "profiled"):
            (base / run).mkdir()
        jobs = ThreadJobTimes()
        with jobs.installed():
            plain = real_tasks.run_one(
                kind, steps, base, base / "plain", profiler=jobs, batch_size=batch_size
            )
        # thread_time: the loop thread's own CPU, not the time a core was taken from it.
        profiler = cProfile.Profile(time.thread_time)
        real_tasks.run_one(
            kind, steps, base, base / "profiled", profiler=profiler, batch_size=batch_size
        )
    return breakdown(kind, plain, pstats.Stats(profiler), top, jobs.seconds)


def run_tree(
    tree: Path | None, kinds: list[str], steps: int, top: int, batch_size: int | None
) -> list[Breakdown]:
    """`kinds` measured in a fresh process of this script, on `tree`'s code (None: this
    checkout's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tree is not None:
        env["PYTHONPATH"] = python_path(tree)
    command = [sys.executable, __file__, "--worker", "--steps", str(steps), "--top", str(top)]
    if batch_size is not None:
        command += ["--batch-size", str(batch_size)]
    done = subprocess.run(
        [*command, "--kinds", *kinds], env=env, check=True, capture_output=True, text=True
    )
    return [converter.structure(row, Breakdown) for row in json.loads(done.stdout)]


def report(
    new: list[Breakdown], old: list[Breakdown], old_rev: str, steps: int, batch_size: int | None
) -> str:
    command = f"--steps {steps}" + ("" if batch_size is None else f" --batch-size {batch_size}")
    title = "" if batch_size is None else f", at {batch_size} rollouts a step"
    lines = [
        f"## Where a real rollout's cost goes{title} (`bench/rollout_profile.py`)",
        "",
        f"`uv run --frozen --group bench python bench/rollout_profile.py {command}` "
        f"(revision {git_revision()} against {old_rev}), on {machine()}.",
        "",
        "The workloads of `bench/real_tasks.py` (the daemon on its own core, the fleet and "
        "trainer on the other), each run twice per revision: once plain, for the figures, "
        "and once under cProfile (timed by the loop thread's CPU clock), for each stage's "
        "share of the event loop's thread, scaled to the plain run. The daemon's worker "
        "threads (tokenization, payload reads, batch writes) are the process's CPU less the "
        "loop thread's. Microseconds of daemon CPU per rollout.",
        "",
        "| workload | old rollouts / daemon CPU s | new | new / old |",
        "|---|---:|---:|---:|",
    ]
    for before, after in zip(old, new, strict=True):
        lines.append(
            f"| {after.kind} | {before.per_cpu_s:.0f} | {after.per_cpu_s:.0f} | "
            f"{after.per_cpu_s / before.per_cpu_s:.2f}x |"
        )
    for before, after in zip(old, new, strict=True):
        lines += [
            "",
            f"**{after.kind}** ({before.rollouts} / {after.rollouts} rollouts), "
            "µs of daemon CPU per rollout:",
            "",
            "| stage | old | new |",
            "|---|---:|---:|",
        ]
        for name in after.stages:
            lines.append(f"| {name} | {before.stages[name]:.0f} | {after.stages[name]:.0f} |")
        lines.append(
            f"| **total** | {sum(before.stages.values()):.0f} | {sum(after.stages.values()):.0f} |"
        )
        heaviest = ", ".join(f"`{name}` {us:.0f}" for name, us in after.top[:8])
        jobs = ", ".join(f"`{name}` {us:.0f}" for name, us in after.thread_jobs[:6])
        lines += [
            "",
            f"Heaviest functions by own time on the loop, new (µs per rollout): {heaviest}.",
            "",
            f"The worker threads' jobs, new (µs of CPU per rollout): {jobs}; the rest of "
            "the row is the threads' hand-offs and threads trio does not start.",
        ]
    return "\n".join(lines)


def _rollouts_per_step(text: str) -> int:
    size = int(text) if text.isdigit() else 0
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"not a positive multiple of 4: {text!r}")
    return size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS[:3]))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--batch-size",
        type=_rollouts_per_step,
        default=None,
        help="rollouts per step, a multiple of the group size 4 (default: the demo's 16)",
    )
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--old", default=DEFAULT_OLD, help="the revision to compare with")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        quiet_daemon_logs()
        os.chdir(real_tasks.ROOT)
        pin_self(plan_cores().daemon)
        rows = [measure_kind(kind, args.steps, args.top, args.batch_size) for kind in args.kinds]
        print(json.dumps(converter.unstructure(rows)))
        return 0

    old = run_tree(old_tree(args.old), args.kinds, args.steps, args.top, args.batch_size)
    new = run_tree(None, args.kinds, args.steps, args.top, args.batch_size)
    markdown = report(new, old, resolve(args.old)[:7], args.steps, args.batch_size)
    print(markdown)
    if not args.no_write:
        section = "rollout_profile" if args.batch_size is None else "rollout_profile_batch"
        write_section(section, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
