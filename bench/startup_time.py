"""Start-up time: `orchestrator check-config configs/demo.toml` and `orchestrator run
--config configs/demo.toml` until its first log line, its first line of its own (the run's
start, after the in-process demo fleet's lines) and its first step, for this checkout and an
older revision side by side in one run.

Each command is a fresh process started as a user starts it (`python -m orchestrator.cli`
in a fresh folder beside the demo's files), with PYTHONDONTWRITEBYTECODE set, as many
containers do: bytecode is what the install compiled (`make setup`), never written by the
run. The old revision is a git worktree of it (bench/_old_tree.py) with its bytecode
compiled, run by this checkout's virtual environment. Every measurement is repeated
(`--repeat`, default 5) alternating old and new, and the median is reported with the range.
A run is stopped by SIGINT once it has logged its first step.

    uv run --frozen --group bench python bench/startup_time.py [--old REV] [--repeat N]
        [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from _old_tree import ROOT, old_tree, python_path, resolve
from _report import git_revision, machine, write_section

#: The revision before the start-up work of issue 33 (math-verify imported by the daemon).
DEFAULT_OLD = "ecaa371"
#: A run that has not logged its first step by then has failed.
RUN_DEADLINE_S = 60.0
PACKAGES = ("orchestrator", "payload-gc/payload_gc", "vllm-writer/orchestrator_vllm")
MARKS = ("first line", "run's first line", "first step")


def environment(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if tree is not None:
        env["PYTHONPATH"] = python_path(tree)
    return env


def time_check_config(tree: Path, env: Mapping[str, str], folder: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "check-config", str(tree / "configs/demo.toml")],
        cwd=folder,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def time_run(tree: Path, env: Mapping[str, str], folder: Path) -> dict[str, float]:
    """Seconds from the start of `orchestrator run` to each of MARKS."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--config",
            str(tree / "configs/demo.toml"),
        ],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert process.stderr is not None
    marks: dict[str, float] = {}
    buffer = b""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stderr, selectors.EVENT_READ)
            while len(marks) < len(MARKS):
                left = RUN_DEADLINE_S - (time.perf_counter() - start)
                if left <= 0 or not selector.select(left):
                    raise RuntimeError(
                        f"no first step within {RUN_DEADLINE_S:.0f} s: {buffer[-500:]!r}"
                    )
                chunk = os.read(process.stderr.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the run ended before its first step: {buffer[-500:]!r}")
                now = time.perf_counter() - start
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    marks.setdefault("first line", now)
                    event = _event(line)
                    if event in ("fresh run", "resuming"):
                        marks.setdefault("run's first line", now)
                    elif event == "step":
                        marks.setdefault("first step", now)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return marks


def _event(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "step" in record and "samples" in record and "groups" in record:
        return "step"
    event = record.get("event")
    return event if isinstance(event, str) else None


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f} to {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help="the revision to compare with")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    old = old_tree(args.old)
    # This checkout's sources may be newer than what `make setup` compiled.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *PACKAGES],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    trees = {"old": (old, environment(old)), "new": (ROOT, environment(None))}
    figures: dict[str, dict[str, list[float]]] = {
        name: {mark: [] for mark in ("check-config", *MARKS)} for name in trees
    }
    for round_ in range(args.repeat):
        for name, (tree, env) in trees.items():
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                (folder / "demo").symlink_to(tree / "demo")
                figures[name]["check-config"].append(time_check_config(tree, env, folder))
                for mark, seconds in time_run(tree, env, folder).items():
                    figures[name][mark].append(seconds)
            print(
                f"startup: round {round_ + 1}/{args.repeat} {name}: "
                + ", ".join(f"{m} {v[-1]:.2f} s" for m, v in figures[name].items()),
                flush=True,
            )

    rows = []
    for mark in ("check-config", *MARKS):
        before, after = figures["old"][mark], figures["new"][mark]
        ratio = statistics.median(before) / statistics.median(after)
        rows.append(f"| {mark} | {spread(before)} | {spread(after)} | {ratio:.2f}x |")
    markdown = "\n".join(
        [
            "## Start-up time (`bench/startup_time.py`)",
            "",
            f"Machine: {machine()}. Revision {git_revision()} against "
            f"{resolve(args.old)[:7]}, {args.repeat} runs each, alternating; "
            "PYTHONDONTWRITEBYTECODE=1, bytecode compiled at install. "
            "Median (range), seconds from the process's start. The first line of "
            "`orchestrator run --config configs/demo.toml` is its `loading tokenizer` where it "
            "logs one (before transformers' import), else the line of the demo's fleet, "
            "which runs in its process; the run's first line is the daemon's `fresh run`, "
            "once the tasks are loaded.",
            "",
            "| measured | old | new | old / new |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(markdown)
    if not args.no_write:
        write_section("startup_time", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
