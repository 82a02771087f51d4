"""Overload: the adaptive in-flight limit against the fixed one, on a fleet that cannot turn
around what the fixed limit lets in.

The shape that showed the waste (bench/system_disk.py's docstring): at most 256 rollouts in
flight on two local servers sharing one core, the demo's mixed 1- and 3-turn environment,
batches of 128 in groups of 8, max_off_policy_steps 2, max_async_steps 1, a trainer step
of 1 s. Requests queued for seconds there and 3-turn groups went stale before they
finished. The local servers have since become fast enough to turn 256 around on their
own, so here each is given a real server's capacity: it generates at most
`--max-num-seqs` requests at once (vLLM's setting of that name; the rest queue) at
`--time-per-token-s` a token, which is what makes turnaround grow with what is sent.

Two runs of the same workload, each with fresh servers and trainer:

1. `inference.inflight_limit = "fixed"`: always 256;
2. `inference.inflight_limit = "adaptive"` with 256 as the ceiling
   (orchestrator/core/inflight.py).

Reported for each: rollouts dispatched and the share discarded as stale (the sink's
`stale` count, groups that arrived too old or were stopped in flight, plus its `swept`
count, queued groups no batch took in time), rollouts completed per second over the
steady window (first shipped batch to the last), the payload root's peak on disk (a walk
of the tree after every shipped batch, or the daemon's own measurement when larger), and
the limits the adaptive run chose. Both runs obey the dispatcher's bound on work in the
pipe (what the batches a new group can still go into can take: docs/design.md §3).

    uv run --frozen --group bench python bench/system_overload.py [--steps N]
        [--max-inflight N] [--verbose]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio
from _report import git_revision, machine, write_section
from system_fleet import (
    CorePlan,
    ModelShape,
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

from orchestrator.daemon.payload_files.disk import tree_bytes
from orchestrator.daemon.run import RunOutcome

SHAPE = ModelShape(layers=48, top_k=8, num_experts=128)
TARGET_STALE_SHARE = 0.05
TARGET_THROUGHPUT_LOSS = 0.10
VERBOSE = False


@attrs.frozen
class RunResult:
    mode: str
    outcome: RunOutcome
    seconds: float
    steady_s: float  # first shipped batch to the last
    completed_steady: int  # rollouts completed in that window
    peak_bytes: int
    limits: list[int]  # the limit in force after each shipped batch

    @property
    def dispatched(self) -> int:
        return sum(self.outcome.state.dispatch.rollouts.values())

    @property
    def stale(self) -> int:
        """Arrived too old (or stopped in flight), and swept from the queue."""
        counters = self.outcome.sink.counters
        return counters.get("stale", 0) + counters.get("swept", 0)

    @property
    def swept(self) -> int:
        """Finished in time, but no batch took them before they went stale."""
        return self.outcome.sink.counters.get("swept", 0)

    @property
    def stale_share(self) -> float:
        return self.stale / self.dispatched if self.dispatched else 0.0

    @property
    def rollouts_per_s(self) -> float:
        return self.completed_steady / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def batches_per_min(self) -> float:
        """Batches shipped per minute from the first shipped batch to the last."""
        return 60 * (len(self.limits) - 1) / self.steady_s if self.steady_s > 0 else 0.0


async def _run(overrides: list[str], mode: str, steps: int) -> RunResult:
    config = demo_config(overrides)
    started = time.perf_counter()
    peak = 0
    limits: list[int] = []
    first_ship: tuple[float, int] | None = None
    last_ship: tuple[float, int] = (0.0, 0)
    async with running_daemon(config) as run:
        state = run.state
        shipped = state.shipping.next_step - 1
        while run.outcome is None:
            await state.wait_changed()
            peak = max(peak, state.payload.bytes)
            if state.shipping.next_step - 1 == shipped:
                continue
            shipped = state.shipping.next_step - 1
            now, completed = time.perf_counter(), state.dispatch.rollouts["completed"]
            if first_ship is None:
                first_ship = (now, completed)
            last_ship = (now, completed)
            limit = state.limits.rollouts or config.inference.max_inflight
            limits.append(limit)
            _, on_disk = await trio.to_thread.run_sync(tree_bytes, config.payload_root)
            peak = max(peak, on_disk)
            if shipped % max(steps // 10, 1) == 0 or VERBOSE:
                print(
                    f"{stamp()} {mode}: step {shipped}, limit {limit}, in flight "
                    f"{state.dispatch.inflight_rollouts}, {on_disk / 1e6:.1f} MB, "
                    f"completed {completed}, "
                    f"rollouts {dict(state.dispatch.rollouts)}",
                    flush=True,
                )
    assert run.outcome is not None and first_ship is not None
    return RunResult(
        mode,
        run.outcome,
        time.perf_counter() - started,
        last_ship[0] - first_ship[0],
        last_ship[1] - first_ship[1],
        max(peak, run.outcome.state.payload.peak_bytes),
        limits,
    )


def run_once(
    mode: str, limits: tuple[int, int], args: argparse.Namespace, base: Path, cores: CorePlan
) -> RunResult:
    extra = [
        f"max_steps={args.steps}",
        f"batch.size={args.batch_size}",
        f"batch.group_size={args.group_size}",
        f"inference.max_inflight={args.max_inflight}",
        f'inference.inflight_limit="{mode}"',
        'payload.mode="by_handle"',
        f"staleness.max_off_policy_steps={limits[0]}",
        f"staleness.max_async_steps={limits[1]}",
        f"sim.train_time_s={args.train_time}",
        "trainer.poll_interval_s=0.05",
        "sim.prompt_len_min=32",
        "sim.prompt_len_max=96",
        "sim.max_tokens=32",
    ]
    capacity = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--time-per-token-s",
        str(args.time_per_token_s),
    ]
    with sim_servers(2, SHAPE, cores.fleet, extra=capacity) as urls:
        run_dir = base / f"{mode}-m{limits[0]}-a{limits[1]}"
        overrides = run_overrides(run_dir, urls, SHAPE, extra)
        with sim_trainer(overrides, cores.fleet, run_dir.with_suffix(".trainer.log")):
            return trio.run(_run, overrides, mode, args.steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per batch")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--train-time", type=float, default=1.0, help="seconds per step")
    parser.add_argument("--max-inflight", type=int, default=256, help="the fixed limit")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="per server")
    parser.add_argument(
        "--staleness",
        default="2:1,2:2",
        help="max_off_policy_steps:max_async_steps pairs, one comparison each",
    )
    parser.add_argument("--time-per-token-s", type=float, default=0.005, help="per server")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-write", action="store_true", help="print, not docs/")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    cores = plan_cores()
    pin_self(cores.daemon)
    quiet_daemon_logs()
    command = "uv run --frozen --group bench python bench/system_overload.py " + " ".join(
        sys.argv[1:]
    )
    shapes = [(int(m), int(a)) for m, a in (pair.split(":") for pair in args.staleness.split(","))]
    tables = []
    with tempfile.TemporaryDirectory(prefix="system-overload-", dir=args.dir) as tmp:
        base = Path(tmp)
        for limits in shapes:
            fixed = run_once("fixed", limits, args, base, cores)
            adaptive = run_once("adaptive", limits, args, base, cores)
            tables.append(comparison(fixed, adaptive, limits, args))
    markdown = report(tables, args, cores.describe(), command)
    print(markdown)
    if not args.no_write:
        write_section("system_overload", markdown)
    return 0


def comparison(
    fixed: RunResult, adaptive: RunResult, limits: tuple[int, int], args: argparse.Namespace
) -> list[str]:
    """The table and verdicts of one staleness shape."""

    def row(name: str, f: str, a: str) -> str:
        return f"| {name} | {f} | {a} |"

    def mb(value: float) -> str:
        return f"{value / 1e6:,.1f} MB"

    later = adaptive.limits[len(adaptive.limits) // 4 :] or adaptive.limits
    rows = [
        f"| | fixed ({args.max_inflight}) | adaptive (ceiling {args.max_inflight}) |",
        "|---|---:|---:|",
        row("rollouts dispatched", f"{fixed.dispatched:,}", f"{adaptive.dispatched:,}"),
        row(
            "discarded stale",
            f"{fixed.stale:,} ({fixed.stale_share:.1%})",
            f"{adaptive.stale:,} ({adaptive.stale_share:.1%})",
        ),
        row(
            "batches shipped per minute",
            f"{fixed.batches_per_min:.1f}",
            f"{adaptive.batches_per_min:.1f}",
        ),
        row(
            "rollouts completed per second (stale ones included)",
            f"{fixed.rollouts_per_s:.0f}",
            f"{adaptive.rollouts_per_s:.0f}",
        ),
        row(
            "of which swept from the queue (finished in time, not taken)",
            f"{fixed.swept:,}",
            f"{adaptive.swept:,}",
        ),
        row("peak payload on disk", mb(fixed.peak_bytes), mb(adaptive.peak_bytes)),
        row(
            "bytes written",
            mb(fixed.outcome.state.payload.bytes_written),
            mb(adaptive.outcome.state.payload.bytes_written),
        ),
        row("run time", f"{fixed.seconds:.0f} s", f"{adaptive.seconds:.0f} s"),
        row(
            "limit after each batch: min / median / max (from step "
            f"{len(adaptive.limits) - len(later) + 1})",
            f"{args.max_inflight}",
            f"{min(later)} / {statistics.median(later):.0f} / {max(later)}",
        ),
    ]
    loss = 1 - adaptive.batches_per_min / fixed.batches_per_min if fixed.batches_per_min else 0.0
    stale_verdict = "met" if adaptive.stale_share < TARGET_STALE_SHARE else "MISSED"
    rate_verdict = "met" if loss <= TARGET_THROUGHPUT_LOSS else "MISSED"
    return [
        f"### max_off_policy_steps {limits[0]}, max_async_steps {limits[1]}",
        "",
        *rows,
        "",
        f"- Stale discards under {TARGET_STALE_SHARE:.0%} of what was dispatched: "
        f"**{stale_verdict}** ({adaptive.stale_share:.1%}; fixed: "
        f"{fixed.stale_share:.1%}).",
        f"- Throughput within {TARGET_THROUGHPUT_LOSS:.0%} of the fixed limit's, in "
        "batches shipped (what the trainer gets; rollouts that go stale are work done "
        f"for nothing): **{rate_verdict}** ({-loss:+.1%}). In rollouts completed, stale "
        f"ones included: {adaptive.rollouts_per_s / fixed.rollouts_per_s - 1:+.1%}.",
        "",
    ]


def report(tables: list[list[str]], args: argparse.Namespace, cores: str, command: str) -> str:
    return "\n".join(
        [
            "## System: overload, adaptive vs fixed in-flight limit (`bench/system_overload.py`)",
            "",
            f"`{command.strip()}` (revision {git_revision()}), on {machine()}.",
            "",
            f"Per staleness shape, two runs of {args.steps} steps by handle, the fixed limit "
            f"then the adaptive one: model {SHAPE.layers} layers top-{SHAPE.top_k} of "
            f"{SHAPE.num_experts} experts, the demo's mixed 1- and 3-turn environment with "
            "prompts of 32..96 tokens and 32 tokens per turn, batches of "
            f"{args.batch_size} in groups of {args.group_size}, a train time of "
            f"{args.train_time:g} s per step; 2 local servers, each generating at most "
            f"{args.max_num_seqs} requests at once at {args.time_per_token_s * 1000:g} ms a "
            "token (the rest queue), and the trainer as separate processes, fresh for each "
            f"run. Cores: {cores}. Stale: the sink's `stale` (arrived too old or stopped in "
            "flight) and `swept` (queued in time, taken by no batch) discards, over the "
            "rollouts dispatched. Batches per minute and rollouts per second: from the "
            "first shipped batch to the last. Peak: the payload root after every shipped "
            "batch, or the daemon's own measurement when larger.",
            "",
            *(line for table in tables for line in table),
        ]
    ).rstrip()


if __name__ == "__main__":
    sys.exit(main())
