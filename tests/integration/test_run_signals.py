"""`orchestrator run` and signals, as a real process sent real signals: a signal during
start-up stops it before anything changes, the first signal while running stops it
gracefully within `shutdown.grace_s`, a second one stops it at once; every stop logs why,
prints the summary and never a traceback."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from cli_kit import ORCHESTRATOR, config_args

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def run_command(config: Path, run_dir: Path, *overrides: str) -> list[str]:
    sets = (f'run_dir="{run_dir}"', "trainer.poll_interval_s=0.1")
    return [*ORCHESTRATOR, "run", *config_args(config, *sets, *overrides)]


# Every rollout request takes seconds (the local servers sleep per generated token), so
# groups are in flight whenever the run is stopped and a graceful stop has to wait.
SLOW = ("sim.time_per_token_s=1.0", 'metrics.listen="127.0.0.1:0"', "max_steps=50")


class Daemon:
    """A running `orchestrator run` whose stderr is read line by line as it comes."""

    def __init__(
        self, command: list[str], *, own_group: bool = False, env: dict[str, str] | None = None
    ) -> None:
        # `own_group`: a process group of its own (as systemd starts a service), so that
        # a signal to the group reaches the daemon and every process it started.
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=own_group,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,))
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_event(self, event: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"exited before {event!r}:\n" + "\n".join(self.lines[-30:]))
            self.lines.append(line)
            record = _json(line)
            if record.get("event") == event:
                return record
        raise AssertionError(f"no {event!r} within {timeout} s")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code, "\n".join(self.lines)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)


def _json(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def events(stderr: str) -> list[dict[str, Any]]:
    return [record for line in stderr.splitlines() if (record := _json(line))]


@contextlib.contextmanager
def running(
    command: list[str], *, own_group: bool = False, env: dict[str, str] | None = None
) -> Iterator[Daemon]:
    daemon = Daemon(command, own_group=own_group, env=env)
    try:
        yield daemon
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait()
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.process.pid, signal.SIGKILL)
        daemon._reader.join(timeout=10)
        assert daemon.process.stderr is not None
        daemon.process.stderr.close()


def test_a_signal_during_start_up_stops_the_run_before_anything_changes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The config file is a FIFO: the daemon blocks reading it, after `run` began and
    # before the config, the start-up checks or trio, so the signal lands in start-up.
    # On a local disk: a network filesystem (the network-mount test mode) has no FIFOs.
    fifo = tmp_path_factory.mktemp("config") / "config.toml"
    os.mkfifo(fifo)
    run_dir = tmp_path / "run"
    root = run_dir / "payloads"
    root.mkdir(parents=True)
    (root / ".payload-root").write_text("")
    (root / "canary.bin").write_bytes(b"a fresh run would wipe this")
    with running(run_command(fifo, run_dir)) as daemon:
        deadline = time.monotonic() + 30
        while True:  # until the daemon has the FIFO open for reading
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO and time.monotonic() < deadline
                assert daemon.process.poll() is None
                time.sleep(0.02)
        daemon.signal(signal.SIGTERM)
        time.sleep(0.3)
        os.set_blocking(writer, True)
        os.write(writer, DEMO.read_bytes())
        os.close(writer)
        code, stderr = daemon.finish()

    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    stopping = [e for e in events(stderr) if e.get("event") == "stopping"]
    assert stopping and stopping[0]["signal"] == "SIGTERM"
    assert stopping[0]["during"] == "start-up"
    assert "== run summary ==" in stderr
    assert "stopped        by SIGTERM, gracefully" in stderr
    assert "steps          0 (this process started at 1)" in stderr
    # Nothing was done: no wipe, no progress, no batch.
    assert (root / "canary.bin").read_bytes() == b"a fresh run would wipe this"
    assert not (run_dir / "orchestrator" / "progress.json").exists()
    assert not any((run_dir / "batches").iterdir())


def test_the_first_signal_waits_for_work_in_flight_at_most_the_grace_time(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    command = run_command(DEMO, run_dir, *SLOW, "shutdown.grace_s=1.5")
    with running(command) as daemon:
        daemon.wait_for_event("metrics endpoint")  # dispatching starts right after
        time.sleep(1.0)
        daemon.signal(signal.SIGTERM)
        signalled = time.monotonic()
        code, stderr = daemon.finish()
        took = time.monotonic() - signalled

    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    stopping = [e for e in events(stderr) if e.get("event") == "stopping"]
    assert [(e["signal"], e["during"]) for e in stopping] == [("SIGTERM", "running")]
    assert "second signal" not in stderr
    # The groups in flight (whose requests take seconds) were waited for, up to the grace.
    assert 1.4 <= took < 10, took
    stopped = [e for e in events(stderr) if e.get("event") == "stopped"]
    assert stopped and stopped[0]["signal"] == "SIGTERM"
    assert "== run summary ==" in stderr
    assert "stopped        by SIGTERM, gracefully" in stderr
    assert "rollouts       " in stderr and "stopped " in stderr
    assert "FAIL" not in stderr
    progress = json.loads((run_dir / "orchestrator" / "progress.json").read_text())
    assert progress["inflight_rollouts"] == 0


def test_a_second_sigterm_stops_at_once_with_the_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = run_command(DEMO, run_dir, *SLOW, "shutdown.grace_s=120")
    with running(command) as daemon:
        daemon.wait_for_event("metrics endpoint")
        time.sleep(1.0)
        daemon.signal(signal.SIGTERM)
        daemon.wait_for_event("stopping")
        time.sleep(0.5)
        # Still draining: the requests in flight take far longer than this.
        assert daemon.process.poll() is None
        daemon.signal(signal.SIGTERM)
        signalled = time.monotonic()
        code, stderr = daemon.finish()
        took = time.monotonic() - signalled

    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert took < 5, took
    assert "Traceback" not in stderr
    forced = [e for e in events(stderr) if e.get("event") == "second signal: stopping now"]
    assert forced and forced[0]["signal"] == "SIGTERM"
    assert "stopped        by SIGTERM, at once (second signal)" in stderr
    assert "== run summary ==" in stderr
    assert "FAIL" not in stderr
    # Progress was still saved whole, and no temp file was left behind.
    json.loads((run_dir / "orchestrator" / "progress.json").read_text())
    assert not [p for p in (run_dir / "orchestrator").iterdir() if p.name.startswith(".tmp")]


TASKS_DEMO = DEMO.parent / "demo.toml"


def test_ctrl_c_to_the_whole_process_group_ends_within_the_grace_without_a_warning(
    tmp_path: Path,
) -> None:
    # As Ctrl-C in a terminal sends it (and `timeout`, systemd's default stop with
    # SIGTERM): to the daemon, its reward workers and its local fleet at once. The workers
    # once died of it under the daemon's graceful stop, which then ended in trio-parallel's
    # BrokenWorkerProcessError. One of the rewards keeps a thread running in its worker,
    # as a library may: the pool's end once waited 10 s for such workers, then warned as
    # if they had been killed from outside.
    run_dir = tmp_path / "run"
    rewards = '["orchestrator.rewards:math_answer", "reward_fixtures:keeps_a_thread"]'
    grace_s = 3.0
    command = run_command(
        TASKS_DEMO,
        run_dir,
        "max_steps=0",
        f"env.0.rewards={rewards}",
        "env.0.reward_weights=[1.0, 0.5]",
        f"shutdown.grace_s={grace_s}",
    )
    fixtures = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([fixtures, os.environ.get("PYTHONPATH", "")]),
    }
    with running(command, own_group=True, env=env) as daemon:
        daemon.wait_for_event("shipped batch", timeout=120)
        os.killpg(daemon.process.pid, signal.SIGINT)
        signalled = time.monotonic()
        code, stderr = daemon.finish()
        took = time.monotonic() - signalled
    assert "Traceback" not in stderr, stderr[-4000:]
    assert code == 0, stderr[-3000:]
    stopped = [e for e in events(stderr) if e.get("event") == "stopped"]
    assert stopped and stopped[0]["signal"] == "SIGINT"
    warnings = [e for e in events(stderr) if e.get("level") == "warning"]
    assert not warnings, warnings
    # Workers busy at the stop are killed with their jobs; idle ones are told to exit, and
    # those the thread keeps alive are killed after a second, in an info line.
    killed = [e for e in events(stderr) if e.get("event") == "reward workers killed at the end"]
    assert all("a thread or a child process" in e["detail"] for e in killed)
    assert "FAIL" not in stderr
    # The grace, plus the workers' short one and the summary (the workers' wait was 10 s).
    assert took < grace_s + 4, took
