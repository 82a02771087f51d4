"""Inference servers that go away: one killed and restarted on its port mid-run, and all
of them gone for longer than `inference.unavailable_deadline_s`.

Servers and daemon are separate processes (the local trainer runs inside the daemon).
A server that comes back must be used again and its absence only counted (connect
failures); a fleet that stays away must stop the daemon with one clear line on stderr,
exit status non-zero and no traceback, within a bounded time.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from _fault_kit import (
    Children,
    SimServer,
    orchestrator_command,
    start_sim_server,
    urls_override,
    write_run_config,
)
from run_kit import free_port

from orchestrator.config import Config
from orchestrator.handoff import shipped_steps

# How long a server stays dead at least before it is restarted on its port.
OUTAGE_S = 2.0
# The daemon must count a connect failure to the dead server within this long (on an idle
# machine it does within a second of the kill: half the groups are pinned to it).
CONNECT_FAILURE_WITHIN_S = 60.0
UNAVAILABLE_DEADLINE_S = 3.0
REQUEST_TIMEOUT_S = 2.0
# Once every server is gone, the daemon must give up within this long: its deadline, a
# request's timeout and retries, and a generous margin for a loaded CI machine.
GIVE_UP_WITHIN_S = 30.0
# Servers slow enough (with few rollouts in flight) that the run is still going when the
# killed one comes back.
SLOW = ("--request-overhead-s", "0.1")


def outage_config(tmp_path: Path, urls: list[str], *overrides: str) -> tuple[Path, Config]:
    path = tmp_path / "run.toml"
    config = write_run_config(
        path,
        tmp_path / "run",
        "sim.inference_servers=0",
        "sim.trainer=true",
        urls_override(urls),
        f"inference.request_timeout_s={REQUEST_TIMEOUT_S}",
        *overrides,
    )
    return path, config


def start_daemon(children: Children, config_path: Path, summary: Path) -> subprocess.Popen[bytes]:
    return children.spawn(
        "daemon",
        orchestrator_command("run", "--config", str(config_path), "--summary-json", str(summary)),
    )


def wait_for_batch(
    children: Children, daemon: subprocess.Popen[bytes], config: Config, step: int
) -> None:
    """Poll until batch `step` is shipped; AssertionError if the daemon dies or stalls."""
    deadline = time.monotonic() + 60
    while step not in shipped_steps(config.batches_dir):
        assert daemon.poll() is None, f"daemon exited early:\n{children.log_tail(daemon)}"
        assert time.monotonic() < deadline, f"no batch {step}:\n{children.log_tail(daemon)}"
        time.sleep(0.01)


def wait_for_connect_failure(
    children: Children, daemon: subprocess.Popen[bytes], url: str, within_s: float
) -> None:
    """Poll the daemon's log until it shows a connect failure to `url` (the first
    rejection of a kind on a server is always logged); AssertionError if the daemon dies
    or none shows within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        for line in children.log_text(daemon).splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(entry, dict)
                and entry.get("event") == "rollout failure"
                and entry.get("kind") == "connect"
                and str(entry.get("server", "")).rstrip("/") == url.rstrip("/")
            ):
                return
        assert daemon.poll() is None, f"daemon exited early:\n{children.log_tail(daemon)}"
        assert time.monotonic() < deadline, (
            f"no connect failure to {url} counted in {within_s} s:\n{children.log_tail(daemon)}"
        )
        time.sleep(0.05)


def wait_for_exit(process: subprocess.Popen[bytes], within_s: float) -> int | None:
    try:
        return process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        return None


def health(server: SimServer) -> dict[str, object]:
    response = httpx.get(f"{server.url}/health", timeout=5)
    response.raise_for_status()
    body: dict[str, object] = response.json()
    return body


@pytest.mark.slow
def test_server_killed_and_restarted_on_its_port_is_counted_not_fatal(
    tmp_path: Path, children: Children
) -> None:
    steps = 10
    ports = [free_port(), free_port()]
    servers = [
        start_sim_server(children, f"server-{i}", port=port, extra=SLOW)
        for i, port in enumerate(ports)
    ]
    config_path, config = outage_config(
        tmp_path,
        [s.url for s in servers],
        f"max_steps={steps}",
        "inference.max_inflight=8",
        # The trainer sets the pace (a step per half second at most), so the run is still
        # going when the restarted server is up, however slowly its interpreter starts.
        "sim.train_time_s=0.5",
    )
    summary = tmp_path / "summary.json"
    daemon = start_daemon(children, config_path, summary)

    wait_for_batch(children, daemon, config, 2)
    servers[1].process.kill()
    servers[1].process.wait()
    killed = time.monotonic()
    # Back only once the daemon has met the dead server (however loaded the machine), and
    # after the outage's least length.
    wait_for_connect_failure(children, daemon, servers[1].url, CONNECT_FAILURE_WITHIN_S)
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
    restarted = start_sim_server(children, "server-1-restarted", port=ports[1], extra=SLOW)
    assert restarted.url == servers[1].url

    shipped_when_back = len(shipped_steps(config.batches_dir))
    # Shown with `pytest -s`: how much of the run was left when the server was up again.
    print(f"\nbatches shipped when server-1 was up again: {shipped_when_back} of {steps}")
    assert shipped_when_back < steps - 1, "the run ended before the server came back"

    code = wait_for_exit(daemon, 120)
    assert code == 0, f"exit {code}:\n{children.log_tail(daemon, 30)}"
    data = json.loads(summary.read_text())
    assert data["steps"] == steps
    assert data["failures"].get("connect", 0) > 0, data["failures"]
    assert all(inv["held"] is True for inv in data["invariants"]), data["invariants"]
    # The daemon went back to the restarted server: it generated, and loaded the last
    # version, like its sibling.
    served = health(restarted)
    assert served["requests_served"] and served["version"] == steps, served
    assert health(servers[0])["version"] == steps


def assert_one_clear_error_line(stderr: str) -> str:
    """Every stderr line is a JSON log line except one error line, the last; no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    plain = []
    for line in stderr.splitlines():
        try:
            json.loads(line)
        except ValueError:
            plain.append(line)
    assert len(plain) == 1, plain[:10]
    assert stderr.splitlines()[-1] == plain[0]
    assert plain[0].startswith("orchestrator run: error: "), plain[0]
    assert "inference" in plain[0], plain[0]
    return plain[0]


@pytest.mark.slow
def test_all_servers_gone_mid_run_stops_the_daemon_with_one_clear_line(
    tmp_path: Path, children: Children
) -> None:
    servers = [start_sim_server(children, f"server-{i}") for i in range(2)]
    config_path, config = outage_config(
        tmp_path,
        [s.url for s in servers],
        "max_steps=50",
        f"inference.unavailable_deadline_s={UNAVAILABLE_DEADLINE_S}",
    )
    daemon = start_daemon(children, config_path, tmp_path / "summary.json")
    wait_for_batch(children, daemon, config, 1)
    for server in servers:
        server.process.kill()
    gone = time.monotonic()

    code = wait_for_exit(daemon, GIVE_UP_WITHIN_S)
    took = time.monotonic() - gone
    assert code is not None, (
        f"the daemon was still running {GIVE_UP_WITHIN_S} s after every server died:\n"
        + children.log_tail(daemon)
    )
    assert code != 0
    assert_one_clear_error_line(children.log_text(daemon))
    assert took >= UNAVAILABLE_DEADLINE_S * 0.5, f"gave up after only {took:.1f} s"


@pytest.mark.slow
def test_servers_that_never_answer_stop_the_daemon_with_one_clear_line(
    tmp_path: Path, children: Children
) -> None:
    # Nothing listens on these ports: every connection is refused from the first request.
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config_path, _ = outage_config(
        tmp_path, urls, "max_steps=5", f"inference.unavailable_deadline_s={UNAVAILABLE_DEADLINE_S}"
    )
    daemon = start_daemon(children, config_path, tmp_path / "summary.json")
    code = wait_for_exit(daemon, GIVE_UP_WITHIN_S)
    assert code is not None, (
        f"the daemon was still running {GIVE_UP_WITHIN_S} s after start with no server up:\n"
        + children.log_tail(daemon)
    )
    assert code != 0
    assert_one_clear_error_line(children.log_text(daemon))
