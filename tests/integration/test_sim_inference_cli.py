"""`orchestrator sim-inference` as a real process: ready line, /health, clean SIGTERM stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import httpx
import pytest


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "sim-inference", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_after(process: subprocess.Popen[str], seconds: float) -> threading.Timer:
    # A guard, not an assertion: a server that never prints its line must not hang the suite.
    timer = threading.Timer(seconds, process.kill)
    timer.start()
    return timer


def test_cli_serves_and_stops_on_sigterm() -> None:
    process = _spawn("--port", "0", "--layers", "4", "--num-experts", "16", "--top-k", "2")
    timer = _kill_after(process, 30)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.removeprefix("listening on ").strip()
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json()["version"] == 0
        body = {
            "request_id": "cli",
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 4},
            "return_routed_experts": True,
        }
        generated = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5)
        assert generated.status_code == 200
        assert generated.json()["choices"][0]["routed_experts"]["shape"][1:] == [4, 2]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        timer.cancel()
        process.kill()
        process.communicate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hang-rate", "1.5"], "--hang-rate"),
        (["--top-k", "9", "--num-experts", "8"], "top_k"),
    ],
)
def test_cli_rejects_bad_options_with_one_line(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "sim-inference", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
