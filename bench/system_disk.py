"""Disk over a long run: payload bytes on disk at every step, with and without early deletion.

Two runs of the same workload (200 steps by default; the demo's model of 48 layers top-8
of 128 experts, its mixed 1- and 3-turn environment and its staleness limits,
max_off_policy_steps 2 and max_async_steps 1, with shorter prompts and turns so it runs in
minutes). Two choices keep the workload's own noise from hiding what the criterion is
about, which is growth:

- batches of 128 samples in groups of 8 (`--batch-size`, `--group-size`): rollouts differ
  in size several times over (turns, prompt and completion lengths), and with the demo's
  batches of 16 that alone moves the bytes on disk by a quarter from step to step;
- a trainer step of 1 s (`--train-time`), as on a cluster, where a step takes minutes:
  with no train time the trainer, sharing a core with the servers, publishes versions at
  irregular moments, so the rollouts dispatched under one version range from a fraction
  of a batch to two, and the bytes on disk swing with them (by a third above the early
  peak now and then, without a trend);
- at most 64 rollouts in flight (`--max-inflight`), what two servers sharing one core
  turn around within a step. An overloaded fleet (more in flight than it turns around
  before groups go stale) is bench/system_overload.py's subject, with the adaptive
  in-flight limit against a fixed one; here the limit stays below what overloads.

The two runs:

1. **as built**: the daemon deletes the files of discarded and swept rollouts at once
   (docs/design.md §6), and the collector removes versions below the bound (docs/design.md §3);
2. **early deletion off**: the same daemon with its discard/sweep deletions skipped, so
   only the collector frees space. There is no switch for this: the benchmark wraps the
   daemon's one deletion method (`PayloadDeleter.delete`) in this process and skips the
   "discard" and "sweep" paths; nothing in the daemon is edited.

In run 1 the wrapper also records, per version directory, the bytes that discards and
sweeps deleted, so the no-early-deletion curve can be *reconstructed* from run 1 alone:
at each step, on-disk bytes plus the early-deleted bytes of versions still at or above
the current collection bound (those below it the collector would have removed by then
anyway). The reconstruction and the measured run 2 are drawn together in
docs/disk_per_step.png.

The payload root's bytes per step are the larger of a walk of the tree after every
shipped batch and the daemon's own measurements during the step (it also measures the
root before every collection).

    uv run --frozen --group bench python bench/system_disk.py [--steps N] [--batch-size N]
        [--train-time S] [--verbose]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio
from _report import git_revision, machine, write_section
from payload_gc import PayloadRootFiles, RootMissing, VersionDirMissing
from system_fleet import (
    REPO,
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

from orchestrator.daemon.payload_files.account import payload_file_key
from orchestrator.daemon.payload_files.disk import PayloadDeleter, tree_bytes
from orchestrator.daemon.run import RunOutcome

PLOT = REPO / "docs" / "disk_per_step.png"
SHAPE = ModelShape(layers=48, top_k=8, num_experts=128)
MAX_OFF_POLICY_STEPS, MAX_ASYNC_STEPS = 2, 1
PEAK_WITHIN = MAX_OFF_POLICY_STEPS + MAX_ASYNC_STEPS + 2
TARGET_OVERSHOOT = 0.10
EARLY_PATHS = ("discard", "sweep")
VERBOSE = False


@attrs.define
class EarlyDeletions:
    """Whether discard/sweep deletions happen, and the bytes they freed per version."""

    enabled: bool = True
    bytes_by_version: Counter[int] = attrs.field(factory=Counter)

    def bytes_at_or_above(self, bound: int | None) -> int:
        return sum(b for version, b in self.bytes_by_version.items() if version >= (bound or 0))


EARLY = EarlyDeletions()
_DAEMON_DELETE = PayloadDeleter.delete


def sizes_by_version(root: Path, paths: Sequence[str]) -> Counter[int]:
    """Bytes of the payload files at `paths` (`<root>/v<k>/<name>`), summed by version and
    looked up through payload_gc as the daemon deletes them. Blocking."""
    sizes: Counter[int] = Counter()
    try:
        opened = PayloadRootFiles(root)
    except RootMissing:
        return sizes
    with opened:
        for path in paths:
            key = payload_file_key(str(root), path)
            if key is None:
                continue
            version, name = key
            try:
                sizes[version] += opened.version(version).lstat(name).st_size
            except (VersionDirMissing, FileNotFoundError):
                continue
    return sizes


async def _observed_delete(self: PayloadDeleter, files: Sequence[str], *, reason: str) -> None:
    """The daemon's deletion, observed (bytes per version) and, when off, skipped."""
    if reason in EARLY_PATHS and files:
        sizes = await trio.to_thread.run_sync(sizes_by_version, self.root, list(files))
        if not EARLY.enabled:
            return
        EARLY.bytes_by_version.update(sizes)
    await _DAEMON_DELETE(self, files, reason=reason)


@attrs.frozen
class DiskSample:
    step: int
    on_disk: int
    files: int
    bound: int | None
    reconstructed: int  # on disk + early-deleted bytes the collector would still hold


@attrs.frozen
class RunResult:
    samples: list[DiskSample]
    outcome: RunOutcome
    seconds: float


async def _run(overrides: list[str], label: str, steps: int) -> RunResult:
    config = demo_config(overrides)
    samples: list[DiskSample] = []
    started = time.perf_counter()
    async with running_daemon(config) as run:
        state = run.state
        shipped = state.shipping.next_step - 1
        # The daemon measures the root itself after each batch and before each collection
        # (into `payload_bytes`); the largest value it reported during a step counts too.
        daemon_max = 0
        while run.outcome is None:
            await state.wait_changed()
            daemon_max = max(daemon_max, state.payload.bytes)
            if state.shipping.next_step - 1 == shipped:
                continue
            shipped = state.shipping.next_step - 1
            bound = state.versions.collected_below
            files, walked = await trio.to_thread.run_sync(tree_bytes, config.payload_root)
            on_disk = max(walked, daemon_max)
            daemon_max = 0
            samples.append(
                DiskSample(shipped, on_disk, files, bound, on_disk + EARLY.bytes_at_or_above(bound))
            )
            if shipped % max(steps // 10, 1) == 0 or VERBOSE:
                print(
                    f"{stamp()} {label}: step {shipped}, {on_disk / 1e6:.1f} MB in {files} "
                    f"files, bound {bound}, applied {state.versions.applied}, in flight "
                    f"{state.dispatch.inflight_rollouts}, "
                    f"completed {state.dispatch.rollouts['completed']}",
                    flush=True,
                )
    assert run.outcome is not None
    return RunResult(samples, run.outcome, time.perf_counter() - started)


def run_once(
    label: str, early_deletion: bool, args: argparse.Namespace, base: Path, cores: CorePlan
) -> RunResult:
    """One run; the fleet on `cores.fleet` (planned before this process pinned itself to
    `cores.daemon`: planned afterwards, it would see one core and pin nothing)."""
    global EARLY
    EARLY = EarlyDeletions(enabled=early_deletion)
    extra = [
        f"max_steps={args.steps}",
        f"batch.size={args.batch_size}",
        f"batch.group_size={args.group_size}",
        f"inference.max_inflight={args.max_inflight}",
        'payload.mode="by_handle"',
        f"staleness.max_off_policy_steps={MAX_OFF_POLICY_STEPS}",
        f"staleness.max_async_steps={MAX_ASYNC_STEPS}",
        f"sim.train_time_s={args.train_time}",
        "trainer.poll_interval_s=0.05",
        "sim.prompt_len_min=32",
        "sim.prompt_len_max=96",
        "sim.max_tokens=32",
    ]
    run_dir = base / label.replace(" ", "-")
    with sim_servers(2, SHAPE, cores.fleet) as urls:
        overrides = run_overrides(run_dir, urls, SHAPE, extra)
        with sim_trainer(overrides, cores.fleet, base / f"{label}-trainer.log"):
            return trio.run(_run, overrides, label, args.steps)


def peak_check(samples: list[DiskSample]) -> tuple[int, int, int, float]:
    """(early peak, its step, later maximum, overshoot ratio - 1)."""
    early = [s for s in samples if s.step <= PEAK_WITHIN]
    later = [s for s in samples if s.step > PEAK_WITHIN]
    peak = max(early, key=lambda s: s.on_disk)
    later_max = max((s.on_disk for s in later), default=0)
    return peak.on_disk, peak.step, later_max, later_max / peak.on_disk - 1


def _mean_on_disk(samples: list[DiskSample], after: int, upto: int) -> float:
    values = [s.on_disk for s in samples if after < s.step <= upto]
    return sum(values) / len(values) if values else 0.0


def draw(as_built: RunResult, without: RunResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    ax.plot(
        [s.step for s in as_built.samples],
        [s.on_disk / 1e6 for s in as_built.samples],
        label="as built (discards deleted at once)",
        color="tab:blue",
    )
    ax.plot(
        [s.step for s in without.samples],
        [s.on_disk / 1e6 for s in without.samples],
        label="early deletion off (measured run)",
        color="tab:red",
    )
    ax.plot(
        [s.step for s in as_built.samples],
        [s.reconstructed / 1e6 for s in as_built.samples],
        label="early deletion off (reconstructed from the first run)",
        color="tab:red",
        linestyle="--",
        alpha=0.7,
    )
    peak, _, _, _ = peak_check(as_built.samples)
    ax.axhline(
        peak * (1 + TARGET_OVERSHOOT) / 1e6,
        color="grey",
        linestyle=":",
        linewidth=1,
        label=f"as built: early peak + {TARGET_OVERSHOOT:.0%} (limit after step {PEAK_WITHIN})",
    )
    ax.axvline(PEAK_WITHIN, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step (batches shipped)")
    ax.set_ylabel("payload bytes on disk (MB)")
    ax.set_title("Payload root on disk per step (max_off_policy_steps 2, max_async_steps 1)")
    highest = max(s.on_disk for s in [*as_built.samples, *without.samples])
    # Head room above the curves for the legend.
    ax.set_ylim(0, highest * 1.45 / 1e6)
    ax.legend(loc="upper center", fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per batch")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--train-time", type=float, default=1.0, help="seconds per step")
    parser.add_argument("--max-inflight", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--plot", type=Path, default=PLOT, help="where to draw the curves")
    args = parser.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    if args.steps <= PEAK_WITHIN + 5:
        parser.error(f"need --steps > {PEAK_WITHIN + 5}")
    cores = plan_cores()
    pin_self(cores.daemon)
    quiet_daemon_logs()
    # The wrapper stays in place for both runs; EARLY says what it does.
    PayloadDeleter.delete = _observed_delete  # type: ignore[method-assign]
    command = "uv run --frozen --group bench python bench/system_disk.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="system-disk-", dir=args.dir) as tmp:
        base = Path(tmp)
        as_built = run_once("as built", True, args, base, cores)
        early_bytes = sum(EARLY.bytes_by_version.values())
        without = run_once("early deletion off", False, args, base, cores)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    draw(as_built, without, args.plot)
    markdown = report(as_built, without, early_bytes, args, cores.describe(), command)
    print(markdown)
    write_section("system_disk", markdown)
    return 0


def report(
    as_built: RunResult,
    without: RunResult,
    early_bytes: int,
    args: argparse.Namespace,
    cores: str,
    command: str,
) -> str:
    peak, peak_step, later_max, overshoot = peak_check(as_built.samples)
    off_peak, off_step, off_later, off_overshoot = peak_check(without.samples)
    verdict = "met" if overshoot <= TARGET_OVERSHOOT else "MISSED"
    built_state, off_state = as_built.outcome.state, without.outcome.state
    final_built, final_off = as_built.samples[-1], without.samples[-1]
    reconstructed_max = max(s.reconstructed for s in as_built.samples)
    half = (PEAK_WITHIN + args.steps) // 2
    try:
        plot_link = args.plot.resolve().relative_to(REPO / "docs")
    except ValueError:
        plot_link = args.plot

    def mb(value: float) -> str:
        return f"{value / 1e6:,.1f} MB"

    rows = [
        "| | as built | early deletion off (measured) |",
        "|---|---:|---:|",
        f"| peak within the first {PEAK_WITHIN} steps | {mb(peak)} (step {peak_step}) | "
        f"{mb(off_peak)} (step {off_step}) |",
        f"| maximum after step {PEAK_WITHIN} | {mb(later_max)} ({overshoot:+.1%}) | "
        f"{mb(off_later)} ({off_overshoot:+.1%}) |",
        f"| daemon's own peak (`RunState.peak_payload_bytes`) | "
        f"{mb(built_state.payload.peak_bytes)} | {mb(off_state.payload.peak_bytes)} |",
        f"| on disk at step {final_built.step} | {mb(final_built.on_disk)} | "
        f"{mb(final_off.on_disk)} |",
        f"| bytes written | {mb(built_state.payload.bytes_written)} | "
        f"{mb(off_state.payload.bytes_written)} |",
        f"| deleted by discards / sweeps | {mb(built_state.payload.bytes_deleted['discard'])} / "
        f"{mb(built_state.payload.bytes_deleted['sweep'])} | 0 / 0 |",
        f"| deleted by the collector | {mb(built_state.payload.bytes_deleted['collection'])} | "
        f"{mb(off_state.payload.bytes_deleted['collection'])} |",
        f"| rollouts completed | {built_state.dispatch.rollouts['completed']:,} | "
        f"{off_state.dispatch.rollouts['completed']:,} |",
        f"| run time | {as_built.seconds:.0f} s | {without.seconds:.0f} s |",
    ]
    return "\n".join(
        [
            "## System: payload disk over a long run (`bench/system_disk.py`)",
            "",
            f"`{command.strip()}` (revision {git_revision()}), on {machine()}.",
            "",
            f"Two runs of {args.steps} steps by handle: model {SHAPE.layers} layers "
            f"top-{SHAPE.top_k} of {SHAPE.num_experts} experts, the demo's mixed environment "
            f"with prompts of 32..96 tokens and 32 tokens per turn, batches of {args.batch_size} "
            f"in groups of {args.group_size} (at most {args.max_inflight} rollouts in "
            f"flight), max_off_policy_steps {MAX_OFF_POLICY_STEPS}, max_async_steps "
            f"{MAX_ASYNC_STEPS}, a train time of {args.train_time:g} s per step; 2 local "
            "servers and the trainer as separate "
            f"processes. Cores: {cores}. Bytes on disk per step: the payload root after "
            "every shipped batch (a walk of the tree in a worker thread), or the daemon's own "
            "measurement during that step (it also measures before each collection) when "
            "larger.",
            "",
            "*Early deletion off* has no switch in the daemon: the benchmark wraps the "
            "daemon's deletion method (`PayloadDeleter.delete`) in its own process and skips the "
            '"discard" and "sweep" paths, so only the version collector frees space. In the '
            "first run the same wrapper records, per version directory, the bytes discards "
            "and sweeps deleted; the *reconstructed* curve adds to each step's on-disk bytes "
            "the early-deleted bytes of versions still at or above that step's collection "
            "bound (the collector would by then have removed those below it, early deletion "
            "or not). It estimates run 2 from run 1 alone; both are drawn.",
            "",
            f"![payload bytes on disk per step]({plot_link})",
            "",
            *rows,
            "",
            f"- Peak reached within the first {PEAK_WITHIN} steps "
            f"(max_off_policy_steps + max_async_steps + 2) and never exceeded by more than "
            f"{TARGET_OVERSHOOT:.0%} afterwards: **{verdict}** (later maximum "
            f"{overshoot:+.1%} against the early peak).",
            f"- No growth: mean on disk over steps {PEAK_WITHIN + 1}..{half} "
            f"{mb(_mean_on_disk(as_built.samples, PEAK_WITHIN, half))}, over steps "
            f"{half + 1}..{args.steps} {mb(_mean_on_disk(as_built.samples, half, args.steps))} "
            f"(early deletion off: {mb(_mean_on_disk(without.samples, PEAK_WITHIN, half))} and "
            f"{mb(_mean_on_disk(without.samples, half, args.steps))}). The step-to-step "
            "swings come from the workload (a random mix of 1-turn and 3-turn rollouts of "
            "random prompt lengths, and which groups happen to be discarded), not from a trend.",
            f"- Early deletion freed {mb(early_bytes)} in the first run; without it the root "
            f"peaks at {mb(max(off_peak, off_later))} (measured) / "
            f"{mb(reconstructed_max)} (reconstructed) instead of {mb(max(peak, later_max))}: "
            f"{max(off_peak, off_later) / max(peak, later_max):.1f}x the disk.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
