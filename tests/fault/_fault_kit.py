"""Helpers of the fault tests: child processes that never outlive a test, local inference
servers as processes, run configs written from the demo, and tree snapshots.

The fixtures that hand these out live in `conftest.py`, which puts this directory on
`sys.path` so that the tests can import the types and helpers from here.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
from cli_kit import ORCHESTRATOR

from orchestrator.config import Config, config_to_toml, load_config

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
# A fresh interpreter imports trio, httpx, numpy and hypercorn: give it time on a busy CI box.
SERVER_READY_DEADLINE_S = 30.0


def orchestrator_command(*args: str) -> list[str]:
    """`python -m orchestrator.cli ARGS`, with the interpreter running the tests."""
    return [*ORCHESTRATOR, *args]


@attrs.define
class Children:
    """Every process a test starts, so that none outlives it (see the `children` fixture).

    Each child's stderr goes to its own file in `log_dir`, never to a pipe nobody reads
    (a full pipe would stall the child and look like a hang).
    """

    log_dir: Path
    processes: list[subprocess.Popen[bytes]] = attrs.field(factory=list)
    logs: dict[int, Path] = attrs.field(factory=dict)

    def spawn(
        self, name: str, args: Sequence[str], *, stdout_pipe: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start `args` with stderr in `<log_dir>/<name>.log` (stdout too, unless piped)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                list(args),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
            )
        self.processes.append(process)
        self.logs[process.pid] = log_path
        return process

    def log_text(self, process: subprocess.Popen[bytes]) -> str:
        """Everything a child wrote to its log so far."""
        return self.logs[process.pid].read_text(errors="replace")

    def log_tail(self, process: subprocess.Popen[bytes], lines: int = 15) -> str:
        """The last lines a child wrote to its log, for an assertion message."""
        return "\n".join(self.log_text(process).splitlines()[-lines:])

    def kill_all(self) -> None:
        """SIGKILL every child still running and reap them all."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
                pass
            if process.stdout is not None:
                process.stdout.close()


@attrs.frozen
class SimServer:
    """A `sim-inference` process and the URL it announced."""

    process: subprocess.Popen[bytes]
    url: str


def start_sim_server(
    children: Children, name: str, *, port: int = 0, extra: Sequence[str] = ()
) -> SimServer:
    """Start `orchestrator sim-inference --port PORT` and wait for its `listening on` line.

    Raises AssertionError (with the server's log) when it exits or stays silent too long.
    """
    process = children.spawn(
        name,
        orchestrator_command("sim-inference", "--port", str(port), *extra),
        stdout_pipe=True,
    )
    line = _read_line(process, SERVER_READY_DEADLINE_S)
    assert line.startswith("listening on http://127.0.0.1:"), (
        f"{name} did not start: {line!r}\n{children.log_tail(process)}"
    )
    return SimServer(process, line.removeprefix("listening on ").strip())


def _read_line(process: subprocess.Popen[bytes], deadline_s: float) -> str:
    """The first stdout line of `process`, or "" when none comes within `deadline_s`."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    data = b""
    end = time.monotonic() + deadline_s
    while b"\n" not in data:
        remaining = end - time.monotonic()
        if remaining <= 0:
            return ""
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # the process closed stdout: it exited
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def run_config(run_dir: Path, *overrides: str) -> Config:
    """The demo config for a test run in `run_dir`: quick training, fast polling."""
    return load_config(
        DEMO,
        [
            f'run_dir="{run_dir}"',
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            *overrides,
        ],
    )


def write_run_config(path: Path, run_dir: Path, *overrides: str) -> Config:
    """Write `run_config(run_dir, *overrides)` as a complete TOML file at `path`."""
    config = run_config(run_dir, *overrides)
    path.write_text(config_to_toml(config))
    # The file must mean what the test thinks it means.
    assert load_config(path) == config
    return config


def urls_override(urls: Sequence[str]) -> str:
    """`inference.urls=[...]` as a `--set` override."""
    return "inference.urls=[" + ", ".join(f'"{url}"' for url in urls) + "]"


def snapshot_tree(top: Path) -> dict[str, bytes]:
    """Every regular file below `top`, by relative path, with its bytes."""
    return {
        str(path.relative_to(top)): path.read_bytes()
        for path in sorted(top.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def plant_tree(top: Path) -> dict[str, bytes]:
    """Create a few files (nested, one named like a version dir) below `top`; snapshot it."""
    files = {
        "notes.txt": b"must survive every collection\n",
        "v0/looks-like-a-payload.bin": bytes(range(256)) * 4,
        "deep/er/data.bin": b"\x00\x01" * 1000,
    }
    for name, data in files.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return snapshot_tree(top)
