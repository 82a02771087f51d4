"""The benchmark's section of docs/benchmarks.md: the setup, the table, the verdicts, the
analysis and the profiles of the largest size."""

from __future__ import annotations

import argparse
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

from _report import git_revision, machine

from _scale.after_run import Timed
from _scale.analysis import conclusions, lag_analysis
from _scale.figures import Figures, marginal_rss
from _scale.formatting import ms, share, verdict
from _scale.measure import SizeResult
from _scale.workload import (
    GROUP_SIZE,
    MAX_INFLIGHT,
    MAX_TOKENS,
    PROMPT_MAX,
    PROMPT_MIN,
    REPEATS,
    SERVERS,
    SHAPE,
    TARGET_BYTES_PER_TOKEN,
    TARGET_READ_S_PER_MTOK,
    TARGET_WORST_LAG_S,
    TARGET_WRITE_S_PER_MTOK,
)


def _profile_table(title: str, timed: Timed) -> list[str]:
    return [
        f"{title} (cProfile, one call; {ms(timed.median)} unprofiled; own time first):",
        "",
        "| own | cumulative | function |",
        "|---:|---:|---|",
        *(
            f"| {ms(own)} | {ms(cumulative)} | `{name}` |"
            for own, cumulative, name in timed.profile
        ),
        "",
    ]


def _table(figures: list[Figures]) -> list[str]:
    def row(label: str, cells: Sequence[str], target: str = "") -> str:
        return f"| {label} | " + " | ".join(cells) + f" | {target} |"

    lag_target = f"<= {ms(TARGET_WORST_LAG_S)}"
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
            [f"**{ms(f.worst_lag_s)}**" for f in figures],
            lag_target,
        ),
        row(
            "p99 / p99.9 lag, 1 ms monitor",
            [f"{ms(f.p99_lag_s)} / {ms(f.p999_lag_s)} ({f.wakeups:,} wake-ups)" for f in figures],
        ),
        row(
            "worst lag, daemon's own monitor (50 ms wake-ups)",
            [f"**{ms(f.daemon_worst_s)}**" for f in figures],
            lag_target,
        ),
        row(
            "p99 lag, daemon's own monitor",
            [ms(f.daemon_p99_s) for f in figures],
        ),
        row(
            "worst lag of the start-up (before dispatch), 1 ms / daemon's monitor",
            [f"{ms(f.size.run.fine_start_up_s)} / {ms(f.daemon_start_up_s)}" for f in figures],
        ),
        row(
            "worst lag while a batch is published / otherwise",
            [f"{ms(f.worst_lag_publishing_s)} / {ms(f.worst_lag_otherwise_s)}" for f in figures],
        ),
        row(
            "the loop thread's CPU time during the worst lag's interval",
            [f"{ms(f.worst_lag_loop_cpu_s)} of {ms(f.worst_lag_interval_s)}" for f in figures],
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
            [ms(f.worst_lag_without_gc_s) for f in figures],
        ),
        row(
            "worst lag of an idle loop publishing the batch (after the run)",
            [ms(f.publish_alone_worst_s) for f in figures],
        ),
        row(
            "longest garbage collection (generation); full ones; objects walked (frozen)",
            [
                f"{ms(f.gc_worst_s)} ({f.gc_worst_generation}); {f.gc_full}; "
                f"{f.size.run.gc_tracked:,} ({f.size.run.gc_heap.frozen:,})"
                for f in figures
            ],
        ),
        row(
            "full collection after the last batch; references followed (in int lists)",
            [
                f"{ms(f.size.run.gc_heap.full_collection_s)}; "
                f"{f.size.run.gc_heap.references:,} "
                f"({share(f.size.run.gc_heap.int_references, f.size.run.gc_heap.references)})"
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
            if (marginal := marginal_rss(figures)) is not None
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
                f"**{f.write_s_per_mtok:.3f} s** ({ms(f.write_s)} a batch, "
                f"{f.write_cpu_share:.0%} of it on CPU)"
                for f in figures
            ],
            f"< {TARGET_WRITE_S_PER_MTOK} s",
        ),
        row(
            "batch write after the run, fsync / none (best)",
            [f"{ms(f.size.write_fsync.best)} / {ms(f.size.write_nofsync.best)}" for f in figures],
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
                f"**{f.read_s_per_mtok:.3f} s** ({ms(f.read_s)} a batch; first "
                f"{ms(f.size.read.seconds[0])}, best {ms(f.size.read.best)})"
                for f in figures
            ],
            f"< {TARGET_READ_S_PER_MTOK} s",
        ),
        row(
            "trainer in the run: batch published to `trained` (median)",
            [
                f"{ms(f.trainer_in_run_s)} ({f.trainer_in_run_per_mtok:.3f} s per M tokens)"
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


def _verdicts(figures: list[Figures]) -> list[str]:
    return [
        f"- {f.size.run.size} samples: worst lag <= {ms(TARGET_WORST_LAG_S)} "
        f"{verdict(f.lag_ok)}; <= {TARGET_BYTES_PER_TOKEN:.0f} B RSS per queued token "
        f"{verdict(f.memory_ok)}; batch write < {TARGET_WRITE_S_PER_MTOK} s per M tokens "
        f"{verdict(f.write_ok)}; trainer read < {TARGET_READ_S_PER_MTOK} s per M tokens "
        f"{verdict(f.read_ok)}."
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
            cwd=Path(__file__).resolve().parents[2],
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    changed = sorted(line[3:] for line in out.splitlines() if line[3:])
    return f", with uncommitted changes to {', '.join(changed)}" if changed else ""


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
            "## System: real scale, a million tokens a step and more (`bench/system_scale.py`"
            + (", everything on every core)" if args.unpinned else ")"),
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
            *conclusions(figures, profiled),
            "",
            *lag_analysis(figures, profiled),
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
