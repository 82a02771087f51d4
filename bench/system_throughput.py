"""Orchestrator ceiling: the daemon's rollouts per second on one core, by handle and inline.

Short single-turn rollouts ("math": prompts of 16..32 tokens, max_tokens 8),
zero-latency simulated servers and a trainer that trains in zero time, so the daemon's own
work (dispatch, HTTP client, stitching, admission, batch publishing, the
collector) is what limits the rate. The daemon runs in this process, pinned to core 0;
the servers (`orchestrator sim-inference`) and the trainer (`orchestrator sim-trainer`)
are separate processes pinned to the other core. Every round is a fresh run with fresh
servers. Three workloads, each with its own rounds: a production MoE with prompts of a
few dozen tokens (the target's), the same with prompts of a few hundred, and a tiny
model whose payloads cost next to nothing, which shows the daemon's fixed cost per
rollout. Per workload, after an unreported warm-up round the modes alternate by handle,
inline, inline, by handle, so drift hits both alike.

Figures per mode: rollouts/s over the steady part of the round (from the first shipped
batch to the last), and rollouts per CPU-second of the daemon's process, which is the
daemon's ceiling even when the servers (sharing one core) are what limits the wall-clock
rate. A last, unreported by-handle round of the target's workload runs under pyinstrument;
the top functions by own time say where the daemon's time goes.

`--old REV` runs every round twice, once on this checkout and once on `REV` (a git
worktree run by this checkout's virtual environment, bench/_old_tree.py, fleet included),
each in a fresh process, and sets the figures side by side: the machines are noisy, so a
speed-up is a ratio taken in one run.

    uv run --frozen --group bench python bench/system_throughput.py
        [--steps N] [--batch-size N] [--servers N] [--no-profile] [--old REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import cattrs
import trio
from _old_tree import old_tree, python_path, resolve
from _report import git_revision, machine, write_section
from system_fleet import (
    CorePlan,
    ModelShape,
    cpu_seconds,
    demo_config,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    run_overrides,
    running_daemon,
    sim_servers,
    sim_trainer,
    stamp,
)

TARGET_ROLLOUTS_PER_S = 1000.0
# The target's shape: a production MoE (48 layers, top-8 of 128 experts, as in
# bench/by_handle_vs_inline.py). A tiny shape, whose routing is a few hundred bytes a
# rollout, shows the daemon's fixed cost per rollout, where inline payloads cost next to
# nothing.


@attrs.frozen
class Workload:
    shape: ModelShape
    prompt_min: int
    prompt_max: int

    def describe(self) -> str:
        shape = self.shape
        return (
            f"{shape.layers} layers top-{shape.top_k} of {shape.num_experts} experts, "
            f"prompts of {self.prompt_min}..{self.prompt_max} tokens"
        )


SHAPES = {
    # The target's workload, short rollouts as the target asks: a production MoE, prompts
    # of a few dozen tokens, inline payloads of some 16 KB a rollout (nearly all routing).
    "moe": Workload(ModelShape(), 16, 32),
    # Prompts of a few hundred tokens, still a tenth of the ~4.5k-token rollouts behind
    # the target's fleet figure: inline payloads of some 230 KB a rollout.
    "moe-long": Workload(ModelShape(), 384, 512),
    # Inline payloads of some 1.5 KB a rollout (routing 0.4 KB of it, the rest the
    # sampling masks, which do not grow with the model): the daemon's fixed cost per rollout.
    "tiny": Workload(ModelShape(layers=4, top_k=2, num_experts=16), 16, 32),
}
TARGET_SHAPE = "moe"
ROUNDS = ("warm_up", "by_handle", "inline", "inline", "by_handle")
TOP_FUNCTIONS = 15
PROFILE_INTERVAL_S = 0.001
# The event loop waiting for I/O: time the daemon had nothing to do.
IDLE = "idle (trio waiting in epoll)"


@attrs.frozen
class RoundResult:
    shape: str
    mode: str
    rollouts: int  # completed rollouts in the steady window
    seconds: float  # the steady window
    cpu_s: float  # the daemon process's CPU time over the same window
    main_cpu_s: float  # of which the event loop's thread (the rest: worker threads)
    total_rollouts: int
    total_s: float
    outcomes: dict[str, int]
    discards: dict[str, int]

    @property
    def rate(self) -> float:
        return self.rollouts / self.seconds

    @property
    def per_cpu_second(self) -> float:
        return self.rollouts / self.cpu_s


def workload_overrides(args: argparse.Namespace, mode: str, workload: Workload) -> list[str]:
    return [
        f"max_steps={args.steps}",
        'sim.env="math"',
        f"sim.prompt_len_min={workload.prompt_min}",
        f"sim.prompt_len_max={workload.prompt_max}",
        "sim.max_tokens=8",
        "sim.max_turns=1",
        f"batch.size={args.batch_size}",
        f"batch.group_size={args.group_size}",
        f"inference.max_inflight={args.max_inflight}",
        "staleness.max_off_policy_steps=2",
        "staleness.max_async_steps=2",
        "sim.train_time_s=0.0",
        "trainer.poll_interval_s=0.05",
        f'payload.mode="{mode}"',
    ]


async def _measure(
    overrides: list[str],
) -> tuple[list[tuple[float, float, float, int]], Counter[str], dict[str, int]]:
    """Run the daemon; sample (wall time, process CPU time, event-loop thread CPU time,
    completed rollouts) at every shipped batch."""
    config = demo_config(overrides)
    samples: list[tuple[float, float, float, int]] = []
    async with running_daemon(config) as run:
        state = run.state
        samples.append((time.perf_counter(), cpu_seconds(), time.thread_time(), 0))
        shipped = state.shipping.next_step
        while run.outcome is None:
            # A cheap poll: waking on every state change would add work to the loop we
            # measure; 10 ms is fine-grained enough for rounds of several seconds.
            await trio.sleep(0.01)
            if state.shipping.next_step != shipped:
                shipped = state.shipping.next_step
                samples.append(
                    (
                        time.perf_counter(),
                        cpu_seconds(),
                        time.thread_time(),
                        state.dispatch.rollouts["completed"],
                    )
                )
    assert run.outcome is not None
    return samples, run.outcome.state.dispatch.rollouts, dict(run.outcome.sink.counters)


def run_round(
    shape_name: str,
    mode: str,
    args: argparse.Namespace,
    cores: CorePlan,
    base: Path,
    number: int,
    profiler: Any = None,
) -> RoundResult:
    run_dir = base / f"round{number}-{shape_name}-{mode}"
    payload_mode = "by_handle" if mode in ("warm_up", "profile") else mode
    workload = SHAPES[shape_name]
    extra = workload_overrides(args, payload_mode, workload)
    shape = workload.shape
    with sim_servers(args.servers, shape, cores.fleet) as urls:
        overrides = run_overrides(run_dir, urls, shape, extra)
        with sim_trainer(overrides, cores.fleet, base / f"trainer{number}.log"):
            started = time.perf_counter()
            # Only the daemon's run is profiled, not the fleet's start-up and shutdown.
            if profiler is not None:
                profiler.start()
            try:
                samples, outcomes, discards = trio.run(_measure, overrides)
            finally:
                if profiler is not None:
                    profiler.stop()
            total_s = time.perf_counter() - started
    # The steady window: from the first shipped batch (servers warm, pipeline full) to
    # the last.
    (t0, c0, m0, r0), (t1, c1, m1, r1) = samples[1], samples[-1]
    return RoundResult(
        shape=shape_name,
        mode=mode,
        rollouts=r1 - r0,
        seconds=t1 - t0,
        cpu_s=c1 - c0,
        main_cpu_s=m1 - m0,
        total_rollouts=outcomes["completed"],
        total_s=total_s,
        outcomes=dict(outcomes),
        discards=discards,
    )


@attrs.frozen
class Profile:
    """Own (self) time of the daemon's main thread, by function and by package."""

    seconds: float
    rollouts: int
    functions: list[tuple[float, str]]
    packages: list[tuple[float, str]]
    # The daemon's own functions by inclusive time (what they and their callees cost).
    inclusive: list[tuple[float, str]]


def profile_round(args: argparse.Namespace, cores: CorePlan, base: Path) -> Profile:
    """One by-handle round under pyinstrument (the main thread, sampled every 1 ms)."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=PROFILE_INTERVAL_S, async_mode="disabled")
    result = run_round(TARGET_SHAPE, "profile", args, cores, base, 99, profiler)
    session = profiler.last_session
    root = session.root_frame() if session is not None else None
    functions: dict[str, float] = {}
    packages: dict[str, float] = {}
    inclusive: dict[str, float] = {}
    stack = [root] if root is not None else []
    while stack:
        frame = stack.pop()
        stack.extend(frame.children)
        if (
            not frame.is_synthetic
            and _package(frame) == "orchestrator"
            and not _has_ancestor(frame, frame.function)
        ):
            name = _frame_name(frame)
            inclusive[name] = inclusive.get(name, 0.0) + frame.time
        own = frame.time - sum(child.time for child in frame.children)
        if own <= 0:
            continue
        # pyinstrument's synthetic "[self]" leaves carry their parent's own time.
        named = frame.parent if frame.is_synthetic_leaf and frame.parent else frame
        functions[_frame_name(named)] = functions.get(_frame_name(named), 0.0) + own
        packages[_package(named)] = packages.get(_package(named), 0.0) + own
    total = sum(packages.values())
    return Profile(
        seconds=total,
        rollouts=result.total_rollouts,
        functions=sorted(((t, n) for n, t in functions.items()), reverse=True)[:TOP_FUNCTIONS],
        packages=sorted(((t, n) for n, t in packages.items()), reverse=True),
        inclusive=sorted(((t, n) for n, t in inclusive.items()), reverse=True)[:TOP_FUNCTIONS],
    )


def _has_ancestor(frame: Any, function: str) -> bool:
    """Whether a caller of `frame` is the same function (recursion: counted once)."""
    parent = frame.parent
    while parent is not None:
        if parent.function == function:
            return True
        parent = parent.parent
    return False


def _package(frame: Any) -> str:
    """The top-level package of a frame's file; C functions count for their caller's."""
    if frame.function == "poll" and "epoll" in str(frame.file_path or "") + frame.function:
        return IDLE
    path = str(frame.file_path_short or frame.file_path or "")
    if not path or path.startswith("<"):
        if frame.function == "epoll.poll":
            return IDLE
        return _package(frame.parent) if frame.parent is not None else "?"
    return Path(path).parts[0].removesuffix(".py")


def _frame_name(frame: Any) -> str:
    path = str(frame.file_path_short or frame.file_path or "?")
    if path.startswith("<") and frame.parent is not None:
        # A C function: name its caller, which is what can be changed.
        return f"{frame.function} (C) in {_frame_name(frame.parent)}"
    return f"{frame.function} ({path}:{frame.line_no})"


def run_rounds(args: argparse.Namespace, cores: CorePlan, base: Path) -> list[RoundResult]:
    """Every workload's rounds on the code this process imports (warm-ups left out)."""
    results: list[RoundResult] = []
    rounds = [(shape, mode) for shape in SHAPES for mode in ROUNDS]
    for number, (shape, mode) in enumerate(rounds):
        result = run_round(shape, mode, args, cores, base, number)
        # stderr: a worker's stdout carries its results.
        print(
            f"{stamp()} round {number} {shape} {mode:9s}: {result.rate:,.0f} rollouts/s "
            f"({result.rollouts:,} in {result.seconds:.2f} s), "
            f"{result.per_cpu_second:,.0f} rollouts per daemon CPU-second "
            f"({1 - result.main_cpu_s / result.cpu_s:.0%} in worker threads), "
            f"outcomes {result.outcomes}, discards {result.discards}",
            file=sys.stderr,
            flush=True,
        )
        if mode != "warm_up":
            results.append(result)
    return results


def rounds_in_process(args: argparse.Namespace, tree: Path | None) -> list[RoundResult]:
    """`run_rounds` in a fresh process of this script, on `tree`'s code (None: this
    checkout's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if tree is not None:
        env["PYTHONPATH"] = python_path(tree)
    command = [
        sys.executable,
        __file__,
        "--worker",
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size)),
        *("--group-size", str(args.group_size), "--max-inflight", str(args.max_inflight)),
        *("--servers", str(args.servers), "--dir", str(args.dir)),
    ]
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return [cattrs.structure(row, RoundResult) for row in json.loads(done.stdout)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="batches per round")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-inflight", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--servers", type=int, default=1, help="sim-inference processes")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled round")
    parser.add_argument("--old", help="an older revision to measure beside this checkout")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("need --steps >= 3 (the steady window starts at the first batch)")
    cores = plan_cores()
    pin_self(cores.daemon)
    quiet_daemon_logs()
    if args.worker:
        with tempfile.TemporaryDirectory(prefix="system-throughput-", dir=args.dir) as tmp:
            results = run_rounds(args, cores, Path(tmp))
        print(json.dumps(cattrs.unstructure(results)))
        return 0
    command = "uv run --frozen --group bench python bench/system_throughput.py " + " ".join(
        sys.argv[1:]
    )
    old: tuple[str, list[RoundResult]] | None = None
    if args.old:
        # The old code first, then this checkout's, each in a fresh process.
        old = (resolve(args.old)[:7], rounds_in_process(args, old_tree(args.old)))
        results = rounds_in_process(args, None)
    profile: Profile | None = None
    with tempfile.TemporaryDirectory(prefix="system-throughput-", dir=args.dir) as tmp:
        base = Path(tmp)
        if old is None:
            results = run_rounds(args, cores, base)
        if not args.no_profile:
            print(f"{stamp()} profiling one more by-handle round", flush=True)
            profile = profile_round(args, cores, base)
    markdown = report(results, old, profile, args, cores, command)
    print(markdown)
    write_section("system_throughput", markdown)
    return 0


def _pooled_rate(rounds: list[RoundResult]) -> float:
    return sum(r.rollouts for r in rounds) / sum(r.seconds for r in rounds)


def _pooled_cpu(rounds: list[RoundResult]) -> float:
    return sum(r.rollouts for r in rounds) / sum(r.cpu_s for r in rounds)


def _of(rounds: list[RoundResult], shape: str, mode: str) -> list[RoundResult]:
    return [r for r in rounds if r.shape == shape and r.mode == mode]


def report(
    results: list[RoundResult],
    old: tuple[str, list[RoundResult]] | None,
    profile: Profile | None,
    args: argparse.Namespace,
    cores: CorePlan,
    command: str,
) -> str:
    """The section of docs/benchmarks.md: `results` are this checkout's rounds, `old` an
    older revision's (its short id and rounds) when `--old` was given."""

    def by_mode(shape: str, mode: str) -> list[RoundResult]:
        return _of(results, shape, mode)

    def describe(name: str) -> str:
        return SHAPES[name].describe()

    rows = [
        "| model | revision | round | mode | rollouts/s | daemon CPU share "
        "| of it in worker threads | rollouts per daemon CPU-s |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    measured = [(git_revision(), results), *([old] if old is not None else [])]
    for revision, rounds in measured:
        for number, result in enumerate(rounds, start=1):
            rows.append(
                f"| {describe(result.shape)} | {revision} | {number} | {result.mode} | "
                f"{result.rate:,.0f} | {result.cpu_s / result.seconds:.0%} | "
                f"{1 - result.main_cpu_s / result.cpu_s:.0%} | {result.per_cpu_second:,.0f} |"
            )
    findings: list[str] = []
    for name in SHAPES:
        handle, inline = by_mode(name, "by_handle"), by_mode(name, "inline")
        if not handle or not inline:
            continue
        handle_rate, inline_rate = _pooled_rate(handle), _pooled_rate(inline)
        handle_cpu, inline_cpu = _pooled_cpu(handle), _pooled_cpu(inline)
        findings.append(
            f"- {describe(name)}: by handle **{handle_cpu:,.0f} rollouts per daemon "
            f"CPU-second** ({handle_rate:,.0f}/s wall clock), inline {inline_cpu:,.0f} per "
            f"daemon CPU-second ({inline_rate:,.0f}/s); by handle / inline "
            f"{handle_cpu / inline_cpu:.2f} on CPU, {handle_rate / inline_rate:.2f} on the "
            f"wall clock. Median round-to-round spread: by handle "
            f"{_spread([r.rate for r in handle]):.0%}, inline "
            f"{_spread([r.rate for r in inline]):.0%}."
        )
        if name == TARGET_SHAPE:
            met_cpu = "met" if handle_cpu >= TARGET_ROLLOUTS_PER_S else "MISSED"
            met_order = "met" if handle_cpu >= inline_cpu else "MISSED"
            findings.append(
                f"- Target (on the {describe(name)} workload) >= {TARGET_ROLLOUTS_PER_S:,.0f} "
                f"rollouts/s by handle on one daemon core: **{met_cpu}**; by handle at least "
                f"as fast as inline on the daemon's core: **{met_order}**. The wall clock is "
                f"set by the servers and trainer sharing the other core: "
                f"{'met' if handle_rate >= TARGET_ROLLOUTS_PER_S else 'missed'} there."
            )
        if old is not None:
            findings.append(_against_old(describe(name), name, results, *old))
    lines = [
        "## System: orchestrator ceiling (`bench/system_throughput.py`)",
        "",
        f"`{command.strip()}` (revision {git_revision()}), on {machine()}.",
        "",
        f'Single-turn "math" rollouts (max_tokens 8), batches of '
        f"{args.batch_size} samples in groups of {args.group_size}, max_inflight "
        f"{args.max_inflight}, max_async_steps 2, {args.steps} batches per round, trainer with "
        f"zero train time; {args.servers} zero-latency `orchestrator sim-inference` "
        "processes. Three workloads: a production MoE with prompts of a few dozen tokens "
        "(the target's short rollouts; inline payloads of some 16 KB a rollout, nearly all "
        "routing), the same model with prompts of a few hundred tokens (still a tenth of the "
        "~4.5k-token rollouts behind the target's fleet figure; inline payloads of some "
        "230 KB), and a tiny model (inline payloads of some 1.5 KB, routing 0.4 KB of it, "
        "the rest sampling masks: the daemon's fixed cost per rollout, where inline costs "
        "next to nothing). Inline routing grows with tokens x layers x top-k; by handle, "
        f"only the file checks and deletions are per file. Cores: {cores.describe()}. Each "
        "round is a fresh run with fresh servers; per workload an unreported warm-up round, "
        "then by handle, inline, inline, by handle. Rates cover the steady window from the "
        "first shipped batch to the last; the CPU figure divides by the daemon process's own "
        "CPU time (every thread) in that window, so it is the daemon's ceiling on one core "
        "whatever limits the wall clock."
        + (
            f" The rounds of {old[0]} (its daemon and fleet) ran first, then this "
            "checkout's, each set in a fresh process."
            if old is not None
            else ""
        ),
        "",
        *rows,
        "",
        *findings,
    ]
    if profile is not None:
        busy = profile.seconds - sum(t for t, name in profile.packages if name == IDLE)
        lines += [
            "",
            f"Where the daemon's time goes: pyinstrument on one extra by-handle round of the "
            f"{describe(TARGET_SHAPE)} workload "
            f"({profile.rollouts:,} rollouts, main thread sampled every "
            f"{PROFILE_INTERVAL_S * 1000:.0f} ms, {profile.seconds:.1f} s recorded, "
            f"{busy:.1f} s busy = {1000 * busy / profile.rollouts:.2f} ms per rollout; the "
            "profiler's hooks slow the daemon several times over, so read the shares, not "
            "the seconds). Own time by package (C functions count for their caller's "
            "package):",
            "",
            "| own time | share | package |",
            "|---:|---:|---|",
            *(
                f"| {t:.2f} s | {t / profile.seconds:.1%} | {name} |"
                for t, name in profile.packages[:10]
            ),
            "",
            "Top functions by own time:",
            "",
            "| own time | share | function |",
            "|---:|---:|---|",
            *(
                f"| {t:.2f} s | {t / profile.seconds:.1%} | `{name}` |"
                for t, name in profile.functions
            ),
            "",
            "The daemon's own functions by inclusive time (their callees included):",
            "",
            "| inclusive time | share | function |",
            "|---:|---:|---|",
            *(
                f"| {t:.2f} s | {t / profile.seconds:.1%} | `{name}` |"
                for t, name in profile.inclusive
            ),
        ]
    return "\n".join(lines)


def _against_old(
    described: str, shape: str, new: list[RoundResult], revision: str, old: list[RoundResult]
) -> str:
    """One workload's rollouts per daemon CPU-second, this checkout against `revision`."""
    parts = []
    for mode in ("by_handle", "inline"):
        before, after = _pooled_cpu(_of(old, shape, mode)), _pooled_cpu(_of(new, shape, mode))
        parts.append(
            f"{mode.replace('_', ' ')} {before:,.0f} -> {after:,.0f} ({after / before:.2f}x)"
        )
    return (
        f"- Against {revision} in the same run, {described}, rollouts per daemon "
        f"CPU-second: {'; '.join(parts)}."
    )


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.mean(values)


if __name__ == "__main__":
    sys.exit(main())
