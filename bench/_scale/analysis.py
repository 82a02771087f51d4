"""The report's text: which targets are met and, for those that are not, where the time
(or memory) goes, and where the event loop's time goes."""

from __future__ import annotations

import os
import statistics

from _scale.figures import Figures, gc_within, laggiest, marginal_rss
from _scale.formatting import ms, share
from _scale.measure import SizeResult
from _scale.recorders import INT_RUN
from _scale.workload import (
    TARGET_BYTES_PER_TOKEN,
    TARGET_READ_S_PER_MTOK,
    TARGET_WORST_LAG_S,
    TARGET_WRITE_S_PER_MTOK,
    TOP_FUNCTIONS,
)


def conclusions(figures: list[Figures], profiled: SizeResult) -> list[str]:
    """Which targets are met and, for those that are not, where the time (or memory) goes,
    in numbers from this run."""
    targets = {
        f"worst lag <= {ms(TARGET_WORST_LAG_S)}": [f.lag_ok for f in figures],
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
    if not all(targets[f"worst lag <= {ms(TARGET_WORST_LAG_S)}"]):
        lines += ["", _lag_causes(laggiest(figures), rows, busy)]
    start_up = max(max(fig.size.run.fine_start_up_s, fig.daemon_start_up_s) for fig in figures)
    if start_up > TARGET_WORST_LAG_S:
        lines += [
            "",
            f"Start-up, not counted above: before dispatch starts the loop stalls up to "
            f"{ms(start_up)} at once (the daemon's own start-up work on its loop, before any "
            "rollout is in flight).",
        ]
    marginal = marginal_rss(figures)
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
        heaviest = ", ".join(f"`{name}` {share(o, total)}" for o, _, name in profile[:3])
        masks = (
            f"{share(full, total)} of it is numpy's `full`, allocating every sample's "
            "sampling mask as an int32 [positions, width] array of -1 before the completion "
            f"rows are read in: {detail.get('mask_bytes', 0) / 2**20:,.0f} MiB for the batch, "
            f"of which the completion rows are "
            f"{share(detail['loss_positions'], detail['positions'])}; the rest is "
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
            f"{ms(largest.write_fsync.best)} (fsync) / {ms(largest.write_nofsync.best)} "
            "(none); most own time: " + ", ".join(f"`{name}` {ms(o)}" for o, _, name in top) + ".",
        ]
    return lines


def _lag_causes(f: Figures, rows: list[tuple[float, float, str]], busy: float) -> str:
    """Why the worst lag misses its target, from this run's figures and the loop profile."""
    run, heap = f.size.run, f.size.run.gc_heap
    steps = [count for _, count, _ in run.long_passes]
    without = f.worst_lag_without_gc_s
    int_share = heap.int_references / heap.references if heap.references else 0.0
    collection = (
        f"A full garbage collection stops the loop for {ms(f.gc_worst_s)} ({f.gc_full} in "
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
        f"{ms(heap.full_collection_s)}. "
    )
    if f.gc_worst_s <= TARGET_WORST_LAG_S:
        collection = (
            f"Garbage collection is not it (the longest took {ms(f.gc_worst_s)}, "
            f"{heap.frozen:,} objects frozen out of it). "
        )
    skip = ("run_daemon", "_run_member ", "_run_rollout ", "run (", "serve (", "_run_group ", "<")
    ours = [
        (cumulative, name)
        for _, cumulative, name in sorted(rows, key=lambda r: -r[1])
        if "orchestrator/" in name and not any(word in name for word in skip)
    ]
    heaviest = [(o, n) for o, _, n in rows if "epoll" not in n][:3]
    ran = f.worst_lag_loop_cpu_s / f.worst_lag_interval_s if f.worst_lag_interval_s else 1.0
    waiting = (
        f"The worst stall ({ms(f.worst_lag_s)}) is not the loop's own work: its thread was "
        f"on a CPU for {ms(f.worst_lag_loop_cpu_s)} of the {ms(f.worst_lag_interval_s)} "
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
        f"the worst lag is {ms(without)}"
        + (" (within the target)" if without <= TARGET_WORST_LAG_S else "")
        + ": passes of the event loop in which many rollout steps run back to back (median "
        f"{statistics.median(steps or [0]):.0f} task steps in the passes over 10 ms), each a "
        "fraction of a millisecond to a few of Python. The loop thread's busy time (cProfile, "
        "below; cumulative, nested calls included) goes to "
        + ", ".join(f"`{name.split(' (')[0]}` {share(c, busy)}" for c, name in ours[:6])
        + "; the most own time: "
        + ", ".join(f"`{name}` {share(o, busy)}" for o, name in heaviest)
        + ". A batch publish overlapping a busy pass stretches it (the worker thread shares "
        "the daemon's core and interpreter lock), though alone it lags an idle loop by "
        f"{ms(f.publish_alone_worst_s)}."
    )


def lag_analysis(figures: list[Figures], profiled: SizeResult) -> list[str]:
    """Where the event loop's time goes: the long passes by task, and the loop thread's
    cProfile (an unreported run)."""
    f = laggiest(figures)
    run = f.size.run
    lines = [
        f"Where the lag comes from ({run.size} samples). Trio runs every runnable task once "
        "per pass of its loop and looks at timers (the lag monitor's wake-up) only between "
        "passes, so a pass's length is the lag it causes. Worst lag while a batch was being "
        f"published {ms(f.worst_lag_publishing_s)}, otherwise {ms(f.worst_lag_otherwise_s)}; "
        "publishing the same batch from a worker thread into an otherwise idle loop (after "
        f"the run) lagged it by {ms(f.publish_alone_worst_s)} at worst; the longest garbage "
        f"collection took {ms(f.gc_worst_s)} (generation {f.gc_worst_generation}).",
    ]
    total = sum(run.long_pass_time.values())
    if run.long_passes:
        lengths = [length for length, _, _ in run.long_passes]
        steps = [count for _, count, _ in run.long_passes]
        lines += [
            "",
            f"{len(lengths)} pass{'es' if len(lengths) != 1 else ''} took over 10 ms "
            f"(longest {ms(max(lengths))}, median "
            f"{statistics.median(steps):.0f} task steps each, {ms(sum(lengths))} in all); "
            "their task steps' time by task (a trio instrument in the measured run):",
            "",
            "| task | share | steps | per step |",
            "|---|---:|---:|---:|",
            *(
                f"| `{name}` | {share(seconds, total)} | {run.long_pass_steps[name]:,} | "
                f"{ms(seconds / max(run.long_pass_steps[name], 1))} |"
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
                f"| {ms(seconds)} | `{name}` | `{where}` | "
                f"{ms(gc_within(run.gc_collections, start, start + seconds))} |"
                for seconds, name, where, start in run.long_steps[:5]
            ),
        ]
    rows = profiled.loop_profile or []
    idle = sum(own for own, _, name in rows if "epoll" in name)
    busy = sum(own for own, _, _ in rows) - idle
    ours = [row for row in sorted(rows, key=lambda r: -r[1]) if "orchestrator/" in row[2]]
    # Entry points and the dispatcher's own loops say nothing about what costs.
    skip = ("run_daemon", "_run_member ", "_run_rollout ", "run (", "serve (", "_run_group ")
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
            f"| {cumulative:.2f} s | {share(cumulative, busy)} | `{name}` |"
            for _, cumulative, name in ours[:12]
        ),
        "",
        "Top functions by own time:",
        "",
        "| own | share | function |",
        "|---:|---:|---|",
        *(
            f"| {own:.2f} s | {share(own, busy)} | `{name}` |"
            for own, _, name in rows[: TOP_FUNCTIONS + 1]
            if "epoll" not in name
        ),
    ]
    return lines
