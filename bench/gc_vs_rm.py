"""Benchmark: payload_gc's async collector (inside trio) against `rm -rf`, and the stat
calls one collection makes.

**Speed.** Builds two identical payload trees (default 20 versions x 10,000 files of
4 KiB), both before timing anything, then deletes them in two halves so that each tool
runs twice and each runs first once:

    half 1: payload_gc collects tree A below v{n/2}, then `rm -rf` removes B's v0..
    half 2: `rm -rf` removes B's remaining versions, then payload_gc collects the rest of A

While payload_gc runs, a task in the same trio loop sleeps 1 ms at a time and records how
late it wakes up: the event loop's worst lag.

**Stat calls.** A root of `--stat-versions` versions to delete and `--stat-kept` versions
to keep, `--stat-files` files each (default 10 + 4 versions of 3,000: 30,000 files go,
12,000 stay). Each way of collecting it runs as its own process under `strace -f -c`,
counting the stat family of system calls (`newfstatat`, `statx`, `fstat`, `lstat`,
`stat`) and the listings (`getdents64`); the same command on an empty root is subtracted
(the interpreter's own start-up). It runs again without strace for its wall-clock time
(`--stat-repeat` times, the median shown), each time on a fresh copy of the root. On a
network filesystem that does not cache attributes (`--dir` on such a mount: sshfs with
`-o dir_cache=no,attr_timeout=0`, NFS with `noac`), every stat is a round trip to the
server, which is what the counts are about.

Writes its section of docs/benchmarks.md (`--print-only`: prints it and writes nothing).

    uv run --frozen python bench/gc_vs_rm.py [--versions N] [--files N] [--size B]
        [--workers N] [--dir DIR] [--part all|speed|stats] [--stat-versions N]
        [--stat-kept N] [--stat-files N] [--stat-repeat N] [--print-only]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import trio.lowlevel
from _report import git_revision, machine, write_section
from payload_gc import collect_below, scan_root

PROBE_INTERVAL_S = 0.001
TARGET_RATIO = 1.0
TARGET_LAG_MS = 20.0
#: Seconds the lag probe runs alone before each collection, to show the machine's baseline.
BASELINE_S = 3.0


def build_version(directory: Path, files: int, payload: bytes) -> None:
    directory.mkdir()
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(files):
            fd = os.open(f"{i:06d}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


def build_trees(base: Path, versions: int, files: int, size: int) -> tuple[Path, Path]:
    """Two identical trees, built version by version side by side (similar placement)."""
    tree_gc, tree_rm = base / "gc", base / "rm"
    tree_gc.mkdir()
    tree_rm.mkdir()
    payload = os.urandom(size)
    started = time.monotonic()
    for version in range(versions):
        for tree in (tree_gc, tree_rm):
            build_version(tree / f"v{version}", files, payload)
        print(
            f"  built v{version} twice ({2 * (version + 1) * files} files, "
            f"{time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return tree_gc, tree_rm


async def _probe(stop: trio.Event, lags: list[float]) -> None:
    """Sleep 1 ms at a time until `stop`, recording how late each wake-up was."""
    while not stop.is_set():
        before = trio.current_time()
        await trio.sleep(PROBE_INTERVAL_S)
        lags.append(trio.current_time() - before - PROBE_INTERVAL_S)


async def _idle_lags(seconds: float) -> list[float]:
    lags: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, stop, lags)
        await trio.sleep(seconds)
        stop.set()
    return lags


async def _gc_with_probe(root: Path, bound: int, workers: int) -> tuple[float, int, list[float]]:
    lags: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, stop, lags)
        # Let the probe take its first sample before the collection starts.
        await trio.lowlevel.checkpoint()
        started = time.perf_counter()
        report = await collect_below(root, bound, max_workers=workers)
        elapsed = time.perf_counter() - started
        stop.set()
    if report.errors:
        raise SystemExit(f"gc_vs_rm: the collection was partial: {report.errors}")
    return elapsed, report.files, lags


def run_gc(root: Path, bound: int, workers: int) -> tuple[float, int, list[float]]:
    return trio.run(_gc_with_probe, root, bound, workers)


def idle_lags(seconds: float) -> list[float]:
    """The probe's lags with nothing else running: this machine's own baseline."""
    return trio.run(_idle_lags, seconds)


def _lag_summary(lags: list[float]) -> str:
    ms = sorted(lag * 1000 for lag in lags)
    if not ms:
        return "no samples"
    return (
        f"worst **{ms[-1]:.1f} ms**, p99 {ms[int(0.99 * (len(ms) - 1))]:.2f} ms, median "
        f"{statistics.median(ms):.2f} ms over {len(ms):,} samples"
    )


async def _rm_with_probe(paths: list[Path]) -> tuple[float, list[float]]:
    lags: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, stop, lags)
        await trio.lowlevel.checkpoint()
        started = time.perf_counter()
        await trio.run_process(["rm", "-rf", "--", *map(str, paths)])
        elapsed = time.perf_counter() - started
        stop.set()
    return elapsed, lags


def run_rm(paths: list[Path]) -> tuple[float, list[float]]:
    """Time `rm -rf` (a separate process, so it shares no interpreter with the probe)
    while the same probe runs in a trio loop: the lag the deletion's I/O alone causes."""
    return trio.run(_rm_with_probe, paths)


def filesystem_of(path: Path) -> str:
    try:
        out = subprocess.run(
            ["df", "--output=fstype,source", str(path)], capture_output=True, text=True, check=True
        ).stdout.split("\n")[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"
    fstype, source = out.split()
    return f"{fstype} ({source})"


# -- stat calls of one collection --------------------------------------------------------

#: The system calls counted as "stat calls", and the listings, under strace.
STAT_SYSCALLS = ("newfstatat", "fstatat64", "statx", "fstat", "lstat", "stat")
COUNTED = (*STAT_SYSCALLS, "getdents64", "unlinkat")

#: The daemon's call, `collect_below` in trio, as its own process.
_ASYNC_COLLECT = """
import sys, trio
from payload_gc import collect_below
report = trio.run(collect_below, sys.argv[1], int(sys.argv[2]))
print(report.outcome, report.dirs, report.files)
"""


def build_stat_root(root: Path, versions: int, kept: int, files: int) -> None:
    """A marked payload root: `versions` versions below the bound, `kept` above it."""
    root.mkdir()
    (root / ".payload-root").write_text("a payload root\n")
    payload = b"x" * 100
    for version in range(versions + kept):
        build_version(root / f"v{version}", files, payload)


def stat_commands(root: Path, bound: int) -> list[tuple[str, list[str]]]:
    gc = [sys.executable, "-m", "payload_gc", "--root", str(root)]
    return [
        ("`payload-gc --below K` (real run)", [*gc, "--below", str(bound)]),
        ("`payload-gc --below K --dry-run`", [*gc, "--below", str(bound), "--dry-run"]),
        (
            "`payload-gc --below K --dry-run --measure-kept`",
            [*gc, "--below", str(bound), "--dry-run", "--measure-kept"],
        ),
        (
            "`collect_below` in trio (the daemon's collection)",
            [sys.executable, "-c", _ASYNC_COLLECT, str(root), str(bound)],
        ),
        (
            "`rm -rf` of the same versions",
            ["rm", "-rf", *(str(root / f"v{v}") for v in range(bound))],
        ),
    ]


def strace_counts(argv: list[str], out: Path) -> dict[str, int]:
    """The number of each counted system call `argv` makes (its children included)."""
    subprocess.run(
        ["strace", "-f", "-c", "-o", str(out), "-e", f"trace={','.join(COUNTED)}", *argv],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    counts = dict.fromkeys(COUNTED, 0)
    for line in out.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] in counts and fields[3].isdigit():
            counts[fields[-1]] = int(fields[3])
    return counts


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def stat_section(args: argparse.Namespace) -> str:
    versions, kept, files = args.stat_versions, args.stat_kept, args.stat_files
    header = [
        "### Stat calls of one collection",
        "",
        f"A marked root of {versions + kept} versions x {files:,} files of 100 bytes: "
        f"{versions} versions ({versions * files:,} files) below the bound, {kept} "
        f"({kept * files:,} files) at or above it, on {filesystem_of(args.dir)}. Counted "
        f"with `strace -f -c` ({', '.join(f'`{c}`' for c in STAT_SYSCALLS)}; listings "
        "`getdents64`), less the same command on an empty root (the interpreter's own "
        "start-up); the time is the median of "
        f"{args.stat_repeat} run(s) without strace, each on a fresh copy.",
        "",
    ]
    if shutil.which("strace") is None:
        return "\n".join([*header, "strace is not installed here: not measured."])
    rows = [
        "| collection | stat calls | of them per file deleted | listings | unlinks | seconds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = Path(tempfile.mkdtemp(prefix="gc_stat-", dir=args.dir))
    try:
        empty = base / "empty"
        build_stat_root(empty, 0, 0, 0)
        for index, (label, _) in enumerate(stat_commands(base, versions)):
            root = base / f"root{index}"
            build_stat_root(root, versions, kept, files)
            try:
                baseline = strace_counts(stat_commands(empty, versions)[index][1], base / "c.txt")
                counts = strace_counts(stat_commands(root, versions)[index][1], base / "c.txt")
            except subprocess.CalledProcessError as exc:
                # E.g. an option an older payload_gc does not have.
                rows.append(f"| {label} | failed (exit status {exc.returncode}) | | | | |")
                shutil.rmtree(root)
                continue
            shutil.rmtree(root)
            times = []
            for _ in range(args.stat_repeat):
                build_stat_root(root, versions, kept, files)
                os.sync()
                times.append(timed(stat_commands(root, versions)[index][1]))
                shutil.rmtree(root)
            seconds = statistics.median(times)
            extra = {name: counts[name] - baseline[name] for name in COUNTED}
            stats = sum(extra[name] for name in STAT_SYSCALLS)
            deleted = versions * files if "dry-run" not in label else 0
            per_file = f"{stats / deleted:.2f}" if deleted else "-"
            rows.append(
                f"| {label} | {stats:,} | {per_file} | {extra['getdents64']:,} | "
                f"{extra['unlinkat']:,} | {seconds:.2f} |"
            )
            print(f"  {label}: {stats:,} stat calls, {seconds:.2f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return "\n".join([*header, *rows])


def speed_section(args: argparse.Namespace) -> str:
    half = args.versions // 2

    base = Path(tempfile.mkdtemp(prefix="gc_vs_rm-", dir=args.dir))
    try:
        print(f"gc_vs_rm: building 2 x {args.versions} x {args.files} files in {base}")
        tree_gc, tree_rm = build_trees(base, args.versions, args.files, args.size)
        fs = filesystem_of(base)
        # Write the trees' data out now, so neither tool's timing pays for the build's
        # writeback; likewise after every timed step (the sync itself is not timed).
        os.sync()

        baseline = idle_lags(BASELINE_S)
        print("gc_vs_rm: half 1: payload_gc first, then rm -rf", flush=True)
        gc1_s, gc1_files, lags1 = run_gc(tree_gc, half, args.workers)
        os.sync()
        rm1_s, rm_lags1 = run_rm([tree_rm / f"v{v}" for v in range(half)])
        os.sync()
        print("gc_vs_rm: half 2: rm -rf first, then payload_gc", flush=True)
        rm2_s, rm_lags2 = run_rm([tree_rm / f"v{v}" for v in range(half, args.versions)])
        os.sync()
        baseline += idle_lags(BASELINE_S)
        gc2_s, gc2_files, lags2 = run_gc(tree_gc, args.versions, args.workers)
        leftovers = [
            name
            for tree in (tree_gc, tree_rm)
            for name in sorted(e.name for e in scan_root(tree, measure=False))
        ]
        if leftovers != [".payload-gc"]:
            raise SystemExit(f"gc_vs_rm: trees not empty afterwards: {leftovers}")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    rm1_files = half * args.files
    rm2_files = (args.versions - half) * args.files
    if (gc1_files, gc2_files) != (rm1_files, rm2_files):
        raise SystemExit(f"gc_vs_rm: payload_gc deleted {gc1_files}+{gc2_files} files")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    gc_rate = (gc1_files + gc2_files) / (gc1_s + gc2_s)
    rm_rate = (rm1_files + rm2_files) / (rm1_s + rm2_s)
    ratio = gc_rate / rm_rate
    worst_ms = max(lags1 + lags2, default=0.0) * 1000

    def row(label: str, order: str, files: int, seconds: float) -> str:
        return f"| {label} | {order} | {files:,} | {seconds:.3f} | {files / seconds:,.0f} |"

    verdict_ratio = "meets" if ratio >= TARGET_RATIO else "misses"
    verdict_lag = "meets" if worst_ms <= TARGET_LAG_MS else "misses"
    return "\n".join(
        [
            f"Two identical trees of {args.versions} versions x {args.files:,} files of "
            f"{args.size:,} bytes, both built (and synced to disk) before either is timed, "
            f"on {fs}. Each tool deletes half the versions twice, running first once (with a "
            "`sync` after each step, not timed). payload_gc runs its async "
            f"API inside trio with {args.workers} worker threads; the loop lag is how late a "
            "task sleeping 1 ms at a time woke up while it ran (and, for reference, while `rm -rf` "
            "ran and while nothing ran).",
            "",
            "| tool | ran | files | seconds | files/s |",
            "|---|---|---:|---:|---:|",
            row("payload_gc", "first", gc1_files, gc1_s),
            row("rm -rf", "second", rm1_files, rm1_s),
            row("rm -rf", "first", rm2_files, rm2_s),
            row("payload_gc", "second", gc2_files, gc2_s),
            "",
            f"- payload_gc: **{gc_rate:,.0f} files/s**; rm -rf: **{rm_rate:,.0f} files/s**; "
            f"ratio **{ratio:.2f}** (target >= {TARGET_RATIO:.1f}: {verdict_ratio})",
            f"- event-loop lag while collecting: {_lag_summary(lags1 + lags2)} "
            f"(target worst <= {TARGET_LAG_MS:.0f} ms: {verdict_lag})",
            f"- the same probe while `rm -rf` runs in a separate process: "
            f"{_lag_summary(rm_lags1 + rm_lags2)}",
            f"- the same probe with nothing else in the process ({2 * BASELINE_S:.0f} s, just "
            f"before each collection): {_lag_summary(baseline)}; the load average was "
            f"{load}",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--files", type=int, default=10_000, help="files per version")
    parser.add_argument("--size", type=int, default=4096, help="bytes per file")
    parser.add_argument("--workers", type=int, default=4, help="payload_gc deletion threads")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--part", choices=("all", "speed", "stats"), default="all")
    parser.add_argument("--stat-versions", type=int, default=10, help="versions that go")
    parser.add_argument("--stat-kept", type=int, default=4, help="versions that stay")
    parser.add_argument("--stat-files", type=int, default=3_000, help="files per version")
    parser.add_argument(
        "--stat-repeat", type=int, default=1, help="timed runs of each (the median is shown)"
    )
    parser.add_argument(
        "--print-only", action="store_true", help="print the section; do not write the docs"
    )
    args = parser.parse_args()
    if args.versions < 2 or args.files < 1:
        parser.error("need --versions >= 2 and --files >= 1")
    if args.stat_versions < 1 or args.stat_kept < 0 or args.stat_files < 1:
        parser.error("need --stat-versions >= 1, --stat-kept >= 0 and --stat-files >= 1")
    if args.stat_repeat < 1:
        parser.error("need --stat-repeat >= 1")
    command = shlex.join(["uv", "run", "--frozen", "python", "bench/gc_vs_rm.py", *sys.argv[1:]])
    sections = []
    if args.part in ("all", "speed"):
        sections.append(speed_section(args))
    if args.part in ("all", "stats"):
        print("gc_vs_rm: stat calls of one collection", flush=True)
        sections.append(stat_section(args))
    markdown = "\n".join(
        [
            "## payload_gc vs `rm -rf` (`bench/gc_vs_rm.py`)",
            "",
            "\n\n".join(sections),
            "",
            f"- machine: {machine()}",
            f"- revision {git_revision()}; command: `{command}`",
        ]
    )
    print(markdown)
    if not args.print_only:
        write_section("gc_vs_rm", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
