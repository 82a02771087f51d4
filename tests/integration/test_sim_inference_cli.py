"""`orchestrator sim-inference` as a real process: ready line, /health, its reply options,
clean SIGTERM stop."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from cli_kit import ORCHESTRATOR, process_refused


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*ORCHESTRATOR, "sim-inference", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_after(process: subprocess.Popen[str], seconds: float) -> threading.Timer:
    # A guard, not an assertion: a server that never prints its line must not hang the suite.
    timer = threading.Timer(seconds, process.kill)
    timer.start()
    return timer


def _ready(process: subprocess.Popen[str]) -> str:
    """The server's URL, from its ready line."""
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), line
    return line.removeprefix("listening on ").strip()


def test_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    process = _spawn("--port", "0", "--layers", "4", "--num-experts", "16", "--top-k", "2")
    timer = _kill_after(process, 30)
    try:
        url = _ready(process)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json()["version"] == 0
        assert health.json()["model"] == "sim-moe"
        body: dict[str, Any] = {
            "request_id": "cli",
            "model": "sim-moe",
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 4, "routed_experts_prompt_start": 1},
        }
        generated = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5)
        assert generated.status_code == 200
        routed = generated.json()["choices"][0]["routed_experts"]
        assert routed["shape"][1:] == [4, 2]
        assert routed["start"] == 1
        body["sampling_params"]["extra_args"] = {"payload_dir": str(tmp_path / "v0")}
        by_handle = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5).json()
        assert [s["field"] for s in by_handle["choices"][0]["payload"]] == [
            "routed_experts",
            "sampling_mask",
        ]
        assert "digest" not in by_handle["choices"][0]["payload"][0]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        timer.cancel()
        process.kill()
        process.communicate()


def test_cli_reply_options(tmp_path: Path) -> None:
    process = _spawn(
        "--reply-form",
        "upstream",
        "--no-sampling-mask",
        "--served-model-name",
        "Qwen/Qwen3-30B-A3B",
        "--max-model-len",
        "16",
        "--vocab-size",
        "100",
    )
    timer = _kill_after(process, 30)
    try:
        url = _ready(process)
        body: dict[str, Any] = {
            "model": "Qwen/Qwen3-30B-A3B",
            "token_ids": [1, 2, 3],
            "sampling_params": {"extra_args": {"payload_dir": str(tmp_path / "v0")}},
        }
        reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5)
        assert reply.status_code == 200
        [choice] = reply.json()["choices"]
        assert isinstance(choice["routed_experts"], str)  # upstream's .npy
        assert choice["sampling_mask"] is None
        assert len(choice["token_ids"]) <= 13  # max_tokens: what the context leaves
        assert not (tmp_path / "v0").exists()
        body["model"] = "sim-moe"
        assert httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5).status_code == 404
    finally:
        timer.cancel()
        process.kill()
        process.communicate()

    process = _spawn("--no-routed-experts", "--payload-digests")
    timer = _kill_after(process, 30)
    try:
        url = _ready(process)
        body = {
            "token_ids": [1, 2, 3],
            "sampling_params": {
                "max_tokens": 4,
                "extra_args": {"payload_dir": str(tmp_path / "v1")},
            },
        }
        reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5)
        [segment] = reply.json()["choices"][0]["payload"]
        assert segment["field"] == "sampling_mask"
        assert len(segment["digest"]) == 32
    finally:
        timer.cancel()
        process.kill()
        process.communicate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hang-rate", "1.5"], "--hang-rate"),
        (["--top-k", "9", "--num-experts", "8"], "top_k"),
        (["--reply-form", "sglang"], "--reply-form"),
        (["--served-model-name", ""], "served_model_name"),
    ],
)
def test_cli_rejects_bad_options_with_one_line(args: list[str], message: str) -> None:
    assert message in process_refused([*ORCHESTRATOR, "sim-inference", *args], timeout=30)


def test_cli_serves_a_prefill_decode_deployment(tmp_path: Path) -> None:
    process = _spawn(
        "--port", "0", "--layers", "4", "--num-experts", "16", "--top-k", "2", "--disaggregated"
    )
    timer = _kill_after(process, 30)
    try:
        url = _ready(process)
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["role"] == "router"
        assert (health["prefill"]["role"], health["decode"]["role"]) == ("prefill", "decode")
        body: dict[str, Any] = {
            "request_id": "cli",
            "token_ids": [1, 2, 3, 4, 5],
            "sampling_params": {
                "max_tokens": 4,
                "routed_experts_prompt_start": 1,
                "extra_args": {"payload_dir": str(tmp_path / "v0")},
            },
        }
        reply = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=5).json()
        segments = reply["choices"][0]["payload"]
        # The prefill side's segments, then the decode side's, in two files.
        assert [(s["field"], s["pos"]) for s in segments][:2] == [
            ("routed_experts", 1),
            ("sampling_mask", 5),
        ]
        assert (segments[2]["field"], segments[2]["pos"]) == ("routed_experts", 4)
        assert len({s["file"] for s in segments}) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        timer.cancel()
        process.kill()
        process.communicate()


def test_cli_refuses_a_side_that_is_also_a_deployment() -> None:
    argv = [*ORCHESTRATOR, "sim-inference", "--disaggregated", "--role", "decode"]
    assert "one side" in process_refused(argv, timeout=30)
