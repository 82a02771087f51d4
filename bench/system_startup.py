"""Start-up sync at scale: a resumed run over a payload root of 1,000,000 files.

Builds, once, a run directory as a run cut short at step S would leave it: batches
1..S, weights v1..vS published, progress saved, and a payload root of V = S + 1 version
directories (v0..vS) of F small files each (default 50 x 20,000 = 1,000,000 files). It
also builds an identical copy of the payload root for `rm -rf`. Everything is synced to
disk before anything is timed.

Then it starts the daemon (in this process, with one local server as a separate
process). The run resumes at S + 1: it applies vS and collects every version below
min_fresh_version(S + 1, m) = S - m (docs/design.md §7), here v0..v(S-m-1), while it dispatches
rollouts of vS. Measured: the time from calling `run_daemon` to the first dispatched
rollout and to the end of the start-up collection, the collection's own duration and
rate (from payload_gc's audit log line), and the event loop's worst lag meanwhile (a task
sleeping 1 ms at a time). After a `sync`, `rm -rf` removes the same version directories
from the copy, timed.

    uv run --frozen --group bench python bench/system_startup.py
        [--versions V] [--files F] [--size B] [--dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio
from _report import git_revision, machine, write_section
from payload_gc import min_fresh_version, scan_root
from system_fleet import (
    ModelShape,
    demo_config,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    run_overrides,
    running_daemon,
    sim_servers,
    stamp,
)

from orchestrator.handoff import Progress, publish_batch, publish_weights, save_progress

MAX_OFF_POLICY_STEPS = 2
SHAPE = ModelShape(layers=4, top_k=2, num_experts=16)
PROBE_INTERVAL_S = 0.001


def build_version(directory: Path, files: int, payload: bytes) -> None:
    """`files` files of `payload` in a new directory, created fd-relative. Blocking."""
    directory.mkdir()
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for index in range(files):
            fd = os.open(
                f"{index:06d}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd
            )
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


def build_roots(roots: list[Path], versions: int, files: int, size: int) -> None:
    """Identical payload roots, version by version; two threads (the syscalls release the
    interpreter lock, so two cores build side by side)."""
    payload = os.urandom(size)
    for root in roots:
        root.mkdir(parents=True)
        # The marker a run's root carries (docs/design.md §7): a resumed run does not need it, but
        # it makes the copy an exact payload root too.
        (root / ".payload-root").write_text("")
    started = time.monotonic()
    jobs = [(root / f"v{version}") for version in range(versions) for root in roots]
    done = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(build_version, job, files, payload) for job in jobs]
        for future in concurrent.futures.as_completed(futures):
            future.result()
            done += 1
            if done % (2 * len(roots)) == 0 or done == len(jobs):
                elapsed = time.monotonic() - started
                print(
                    f"{stamp()} built {done}/{len(jobs)} version dirs "
                    f"({done * files:,} files, {elapsed:.0f} s, {done * files / elapsed:,.0f} "
                    "files/s)",
                    flush=True,
                )


def build_run_state(config_run_dir: Path, batches: Path, weights: Path, last_step: int) -> None:
    """Batches 1..last_step (empty), weights v1..v_last_step, progress at last_step."""
    for step in range(1, last_step + 1):
        publish_batch(batches, step, [], fsync=False)
        publish_weights(weights, step, fsync=False)
    save_progress(
        config_run_dir / "orchestrator",
        Progress(
            step=last_step,
            applied_version=last_step,
            bound=min_fresh_version(last_step, MAX_OFF_POLICY_STEPS),
            updated_at=time.time(),
        ),
    )


@attrs.frozen
class StartupResult:
    to_first_rollout_s: float
    to_started_s: float  # run_daemon's task_status.started (dispatcher running)
    to_collected_s: float  # the start-up collection done (the bound reached)
    rollouts_meanwhile: int  # rollouts completed before the collection was done
    files_collected: int
    bytes_collected: int
    audit_files: int
    collection_s: float  # from the audit log
    worst_lag_s: float
    worst_lag_at_s: float  # when the worst stall ended, from start
    worst_lag_in_collection_s: float
    collection_started_s: float  # from start
    lag_samples: int


async def _start_up(overrides: list[str], bound: int) -> StartupResult:
    config = demo_config(overrides)
    lags: list[tuple[float, float]] = []  # (wall time at wake-up, lag)

    async def probe() -> None:
        while True:
            before = trio.current_time()
            await trio.sleep(PROBE_INTERVAL_S)
            lags.append((time.time(), trio.current_time() - before - PROBE_INTERVAL_S))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        await trio.sleep(0.01)
        started, wall_started = time.perf_counter(), time.time()
        async with running_daemon(config) as run:
            state = run.state
            to_started = time.perf_counter() - started
            # The dispatcher counts a rollout in flight as it starts the group's task.
            # Polled: nothing notifies when a group starts. 1 ms keeps the poll off the CPU.
            while state.dispatch.inflight_rollouts == 0 and not state.dispatch.rollouts:  # noqa: ASYNC110
                await trio.sleep(0.001)
            to_first = time.perf_counter() - started
            while state.versions.collected_below is None or state.versions.collected_below < bound:
                await state.wait_changed()
            to_collected = time.perf_counter() - started
            rollouts_meanwhile = state.dispatch.rollouts["completed"]
            files = state.payload.files_deleted["collection"]
            freed = state.payload.bytes_deleted["collection"]
        nursery.cancel_scope.cancel()
    audit_files, audit_start, audit_s = _start_up_collection(config.payload_root)
    # A lag belongs to the collection when the stall it measures overlaps it.
    during = [
        lag
        for woke, lag in lags
        if woke >= audit_start and woke - lag - PROBE_INTERVAL_S <= audit_start + audit_s
    ]
    worst_at, worst = max(lags, key=lambda sample: sample[1], default=(0.0, 0.0))
    return StartupResult(
        to_first_rollout_s=to_first,
        to_started_s=to_started,
        to_collected_s=to_collected,
        rollouts_meanwhile=rollouts_meanwhile,
        files_collected=files,
        bytes_collected=freed,
        audit_files=audit_files,
        collection_s=audit_s,
        worst_lag_s=worst,
        worst_lag_at_s=worst_at - wall_started,
        worst_lag_in_collection_s=max(during, default=0.0),
        collection_started_s=audit_start - wall_started,
        lag_samples=len(lags),
    )


def _start_up_collection(root: Path) -> tuple[int, float, float]:
    """(files, start as a Unix time, seconds) of the largest collection in payload_gc's
    audit log: the start-up one (the only one in this run, unless a version was
    published meanwhile)."""
    best = (0, 0.0, 0.0)
    audit = root / ".payload-gc" / "audit.jsonl"
    for line in audit.read_text().splitlines():
        record = json.loads(line)
        if record.get("action") == "collect" and int(record["files"]) >= best[0]:
            started = dt.datetime.fromisoformat(str(record["time"])).timestamp()
            best = (int(record["files"]), started, float(record["duration_s"]))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=50)
    parser.add_argument("--files", type=int, default=20_000, help="files per version")
    parser.add_argument("--size", type=int, default=512, help="bytes per file")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if args.versions < MAX_OFF_POLICY_STEPS + 2:
        parser.error(f"need --versions >= {MAX_OFF_POLICY_STEPS + 2}")
    last_step = args.versions - 1
    bound = min_fresh_version(last_step + 1, MAX_OFF_POLICY_STEPS)
    cores = plan_cores()
    command = "uv run --frozen --group bench python bench/system_startup.py " + " ".join(
        sys.argv[1:]
    )
    base = Path(tempfile.mkdtemp(prefix="system-startup-", dir=args.dir))
    try:
        run_dir, copy = base / "run", base / "copy"
        total = args.versions * args.files
        print(f"{stamp()} building 2 x {total:,} files in {base}", flush=True)
        build_started = time.monotonic()
        build_roots([run_dir / "payloads", copy], args.versions, args.files, args.size)
        build_run_state(run_dir, run_dir / "batches", run_dir / "weights", last_step)
        os.sync()
        build_s = time.monotonic() - build_started
        pin_self(cores.daemon)
        quiet_daemon_logs()
        print(f"{stamp()} resuming the run at step {last_step + 1} (bound v{bound})", flush=True)
        with sim_servers(1, SHAPE, cores.fleet) as urls:
            extra = [
                f"max_steps={last_step + 10}",
                'payload.mode="by_handle"',
                f"staleness.max_off_policy_steps={MAX_OFF_POLICY_STEPS}",
                "staleness.max_async_steps=1",
                "trainer.poll_interval_s=0.05",
            ]
            result = trio.run(_start_up, run_overrides(run_dir, urls, SHAPE, extra), bound)
        os.sync()
        print(f"{stamp()} rm -rf of the same {bound} version dirs in the copy", flush=True)
        rm_started = time.perf_counter()
        subprocess.run(
            ["rm", "-rf", "--", *(str(copy / f"v{v}") for v in range(bound))], check=True
        )
        rm_s = time.perf_counter() - rm_started
        left = sorted(
            e.name for e in scan_root(run_dir / "payloads", measure=False) if e.name.startswith("v")
        )
    finally:
        print(f"{stamp()} removing {base}", flush=True)
        shutil.rmtree(base, ignore_errors=True)
    expected = bound * args.files
    if result.files_collected != expected:
        raise SystemExit(
            f"system_startup: the start-up collection removed {result.files_collected:,} "
            f"files, expected {expected:,}"
        )
    markdown = report(result, rm_s, expected, left, build_s, args, bound, cores.describe(), command)
    print(markdown)
    write_section("system_startup", markdown)
    return 0


def report(
    result: StartupResult,
    rm_s: float,
    expected: int,
    left: list[str],
    build_s: float,
    args: argparse.Namespace,
    bound: int,
    cores: str,
    command: str,
) -> str:
    total = args.versions * args.files
    gc_rate = result.audit_files / result.collection_s if result.collection_s else 0.0
    rm_rate = expected / rm_s
    return "\n".join(
        [
            "## System: start-up sync at scale (`bench/system_startup.py`)",
            "",
            f"`{command.strip()}` (revision {git_revision()}), on {machine()}.",
            "",
            f"A run cut short after step {args.versions - 1}: batches and weights "
            f"1..{args.versions - 1}, progress saved, and a payload root of {args.versions} "
            f"versions x {args.files:,} files of {args.size} bytes = **{total:,} files**; an "
            f"identical copy for `rm -rf` (both built in {build_s:.0f} s and synced before "
            f"timing). The daemon resumes at step {args.versions}, applies "
            f"v{args.versions - 1} and collects below v{bound} (max_off_policy_steps "
            f"{MAX_OFF_POLICY_STEPS}): {expected:,} files in v0..v{bound - 1}, while it "
            f"dispatches rollouts of v{args.versions - 1}. One local server as a separate "
            f"process; cores: {cores}.",
            "",
            "| | seconds | files/s |",
            "|---|---:|---:|",
            f"| `run_daemon` called -> first rollout dispatched | "
            f"{result.to_first_rollout_s:.2f} | |",
            f"| `run_daemon` called -> start-up collection done | {result.to_collected_s:.2f} | |",
            f"| start-up collection (payload_gc audit log) | {result.collection_s:.2f} | "
            f"{gc_rate:,.0f} |",
            f"| `rm -rf` of the same {bound} version dirs (copy) | {rm_s:.2f} | {rm_rate:,.0f} |",
            "",
            f"- First rollout dispatched **{result.to_first_rollout_s:.1f} s** after start "
            f"(dispatcher running after {result.to_started_s:.1f} s). The collection ran "
            f"beside the rollouts for {result.collection_s:.1f} s, done "
            f"{result.to_collected_s:.1f} s after start; {result.rollouts_meanwhile:,} "
            "rollouts completed meanwhile.",
            f"- Collection rate **{gc_rate:,.0f} files/s** against `rm -rf` "
            f"**{rm_rate:,.0f} files/s**: ratio {gc_rate / rm_rate:.2f}.",
            f"- Event loop (a task sleeping 1 ms at a time, {result.lag_samples:,} samples): "
            f"worst lag **{result.worst_lag_in_collection_s * 1000:.1f} ms during the "
            f"collection** (which started {result.collection_started_s:.2f} s in); worst "
            f"over the whole start-up {result.worst_lag_s * 1000:.1f} ms, ending "
            f"{result.worst_lag_at_s:.2f} s in.",
            f"- Version dirs left in the run's root: {', '.join(left)}; "
            f"{result.bytes_collected / 1e6:,.0f} MB freed.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
