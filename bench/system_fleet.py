"""Shared by the system benchmarks (not a benchmark itself): a run split over processes.

The daemon runs in the benchmark's own process, so its CPU time, its RSS and its
`RunState` are what the benchmark measures. The inference servers (`orchestrator
sim-inference`) and the local trainer (`orchestrator sim-trainer`) run as separate
processes, so their work neither shows up in the daemon's RSS nor shares its interpreter
lock. On a machine with at least two cores the daemon is pinned to core 0 and the fleet
to the other cores (`os.sched_setaffinity`), so the daemon has one core to itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import attrs
import trio

import orchestrator
from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.daemon.run_state import RunState
from orchestrator.logs import configure_logging

REPO = Path(__file__).resolve().parent.parent
# The config of the tree whose code runs (an older revision's, for a comparison: its code
# refuses keys that came after it).
DEMO = Path(orchestrator.__file__).resolve().parents[1] / "configs" / "sim.toml"


@attrs.frozen
class ModelShape:
    """The simulated MoE shape, for both the servers' flags and the config's `[sim]`."""

    layers: int = 48
    top_k: int = 8
    num_experts: int = 128

    def server_flags(self) -> list[str]:
        return [
            f"--layers={self.layers}",
            f"--top-k={self.top_k}",
            f"--num-experts={self.num_experts}",
        ]

    def overrides(self) -> list[str]:
        return [
            f"sim.layers={self.layers}",
            f"sim.top_k={self.top_k}",
            f"sim.num_experts={self.num_experts}",
        ]


@attrs.frozen
class CorePlan:
    """Which cores the daemon and the fleet run on (empty sets: no pinning)."""

    daemon: frozenset[int]
    fleet: frozenset[int]

    def describe(self) -> str:
        if not self.daemon:
            return "not pinned (the daemon, the servers and the trainer share every core)"
        return (
            f"daemon pinned to core {sorted(self.daemon)}, servers and trainer to "
            f"core(s) {sorted(self.fleet)} (`os.sched_setaffinity`)"
        )


#: The cores this process may use as it starts, before a benchmark pins itself to the
#: daemon's: a plan made after that pinning would see one core and pin nothing, and the
#: fleet started then would inherit the daemon's core.
_START_CORES = frozenset(os.sched_getaffinity(0))


def plan_cores() -> CorePlan:
    """Core 0 for the daemon, the rest for the fleet; no pinning on a one-core machine.
    The same plan whenever it is made (from the cores the process started with)."""
    cores = sorted(_START_CORES)
    if len(cores) < 2:
        return CorePlan(frozenset(), frozenset())
    return CorePlan(frozenset(cores[:1]), frozenset(cores[1:]))


def pin_self(cores: frozenset[int]) -> None:
    """Pin this process (every thread started after this call) to `cores`, and make
    SIGTERM unwind it like Ctrl-C, so the fleet's processes are stopped too."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if cores:
        os.sched_setaffinity(0, cores)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def quiet_daemon_logs() -> None:
    """JSON log lines at WARNING and above: the benchmark prints its own progress, and a
    line per shipped batch on a terminal would cost more than the daemon's work."""
    configure_logging(json_lines=True, level=logging.WARNING)


def _spawn(
    args: Sequence[str], cores: frozenset[int], log_path: Path | None
) -> subprocess.Popen[str]:
    stderr = log_path.open("w") if log_path is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    finally:
        if log_path is not None:
            stderr.close()  # type: ignore[union-attr]
    if cores:
        os.sched_setaffinity(process.pid, cores)
    return process


def _stop(processes: Sequence[subprocess.Popen[str]]) -> None:
    """SIGTERM all, then wait for each (killing what does not stop within 30 s)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@contextlib.contextmanager
def sim_servers(
    count: int, shape: ModelShape, cores: frozenset[int], *, extra: Sequence[str] = ()
) -> Iterator[list[str]]:
    """Start `count` sim-inference processes on `cores`; yield their URLs; stop them."""
    processes = [
        _spawn(["sim-inference", "--port", "0", *shape.server_flags(), *extra], cores, None)
        for _ in range(count)
    ]
    try:
        urls = []
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError(f"sim-inference did not start: {line!r}")
            urls.append(line.removeprefix("listening on ").strip())
        yield urls
    finally:
        _stop(processes)


@contextlib.contextmanager
def sim_trainer(overrides: Sequence[str], cores: frozenset[int], log_path: Path) -> Iterator[None]:
    """Run `orchestrator sim-trainer` with the demo config and `overrides` on `cores`."""
    args = ["sim-trainer", "--config", str(DEMO)]
    for override in overrides:
        args += ["--set", override]
    process = _spawn(args, cores, log_path)
    try:
        yield
    finally:
        _stop([process])


def run_overrides(
    run_dir: Path, urls: Sequence[str], shape: ModelShape, extra: Sequence[str]
) -> list[str]:
    """`--set` overrides for a run whose servers and trainer are separate processes."""
    quoted = ", ".join(f'"{url}"' for url in urls)
    return [
        f'run_dir="{run_dir}"',
        "sim.inference_servers=0",
        "sim.trainer=false",
        f"inference.urls=[{quoted}]",
        *shape.overrides(),
        *extra,
    ]


def demo_config(overrides: Sequence[str]) -> Config:
    return load_config(DEMO, overrides)


@attrs.frozen
class DaemonRun:
    """The daemon running in this process (see `running_daemon`)."""

    state: RunState
    _ended: list[RunOutcome]

    @property
    def outcome(self) -> RunOutcome | None:
        """What the run returned, once it has ended."""
        return self._ended[0] if self._ended else None


@contextlib.asynccontextmanager
async def running_daemon(config: Config) -> AsyncIterator[DaemonRun]:
    """`run_daemon(config)` in this process, entered once it is dispatching. When the run
    ends (at `max_steps`), the block is cancelled; when the block ends, so is the run."""
    ended: list[RunOutcome] = []
    async with trio.open_nursery() as nursery:

        async def daemon(task_status: trio.TaskStatus[RunState]) -> None:
            ended.append(await launch_run(config, task_status=task_status))
            nursery.cancel_scope.cancel()

        yield DaemonRun(await nursery.start(daemon), ended)
        nursery.cancel_scope.cancel()


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds() -> float:
    """CPU time (user + system) this process has used so far, every thread included."""
    times = os.times()
    return times.user + times.system


def stamp() -> str:
    return time.strftime("%H:%M:%S")
