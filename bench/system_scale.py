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
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import write_section
from _scale.measure import SizeResult, measure_size
from _scale.report import report
from _scale.workload import PROFILE_STEPS, SIZES
from system_fleet import CorePlan, pin_self, plan_cores, quiet_daemon_logs, stamp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument(
        "--steps", type=int, default=5, help="batches per size (the trainer reads all but one)"
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="pin nothing: the daemon, the servers and the trainer share every core, as on "
        "a head node that also serves (the issue's lag goal is measured so)",
    )
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
    cores = CorePlan(frozenset(), frozenset()) if args.unpinned else plan_cores()
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
            extra += ["--unpinned"] if args.unpinned else []
            results.append(_in_worker(size, args.steps, Path(tmp) / f"size-{size}", extra))
        # One more, unreported run of the largest size with the event loop's thread under
        # cProfile, whose overhead would distort the figures above.
        largest = max(args.sizes)
        print(f"{stamp()} batches of {largest} under cProfile: {PROFILE_STEPS} steps", flush=True)
        profiled = _in_worker(
            largest,
            PROFILE_STEPS,
            Path(tmp) / "profiled",
            ["--profile-loop", "--no-pass-timer", *(["--unpinned"] if args.unpinned else [])],
        )
    markdown = report(results, profiled, args, cores.describe(), command)
    print(markdown)
    if not args.no_write:
        write_section("system_scale_shared" if args.unpinned else "system_scale", markdown)
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
