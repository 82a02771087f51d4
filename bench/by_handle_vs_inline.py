"""Payloads by handle vs inline: response bytes and request latency on the local server.

The workload of the by-handle design's GPU measurement (docs/design.md §1): 16 requests of 500 to
8,000 prompt tokens, 256 new tokens, concurrency 8, the default model shape (48 layers,
top-8 of 128 experts), routed experts and sampling masks requested, the same seeds in
both modes. Each round runs a fresh `orchestrator sim-inference` process (a cold prefix
cache, so both modes return every row) on one core while this client runs on the other.
After an unreported warm-up round, rounds alternate inline, by handle, by handle, inline,
so drift hits both modes alike.

After timing, every by-handle array is read back from its file and compared with the
inline array of the same request: the figures are only worth reporting if they are equal.

Run: uv run --frozen python bench/by_handle_vs_inline.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio
from _report import git_revision, machine, write_section

from orchestrator.payload import decode_inline

COMMAND = "uv run --frozen python bench/by_handle_vs_inline.py"
REQUESTS = 16
MIN_PROMPT, MAX_PROMPT = 500, 8000
MAX_TOKENS = 256
CONCURRENCY = 8
# The first round only warms up (page cache, imports, allocator) and is not reported.
ROUNDS = ("warm_up", "inline", "by_handle", "by_handle", "inline")


def _workload() -> list[dict[str, Any]]:
    """The 16 request bodies without payload_dir (same seeds in every round)."""
    rng = np.random.default_rng(2026)
    lengths = np.linspace(MIN_PROMPT, MAX_PROMPT, REQUESTS).round().astype(int)
    rng.shuffle(lengths)
    bodies = []
    for index, length in enumerate(lengths.tolist()):
        bodies.append(
            {
                "request_id": f"bench-{index}",
                "token_ids": rng.integers(0, 32000, size=length).tolist(),
                "sampling_params": {
                    "max_tokens": MAX_TOKENS,
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "top_k": 50,
                    "seed": index,
                },
                "return_routed_experts": True,
                "return_sampling_mask": True,
            }
        )
    return bodies


def _with_payload_dir(body: dict[str, Any], payload_dir: Path | None) -> dict[str, Any]:
    if payload_dir is None:
        return body
    params = {**body["sampling_params"], "extra_args": {"payload_dir": str(payload_dir)}}
    return {**body, "sampling_params": params}


class _Server:
    """A fresh `orchestrator sim-inference` process with the default model shape."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "sim-inference", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def wait_url(self) -> str:
        """Block until the server prints its listening line; return its URL."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("listening on "):
            self.process.kill()
            raise RuntimeError(f"sim-inference did not start: {line!r}")
        return line.removeprefix("listening on ").strip()

    def stop(self) -> None:
        """SIGTERM, then wait for the exit (blocking)."""
        self.process.terminate()
        self.process.wait(timeout=30)


async def _run_round(
    url: str, bodies: list[dict[str, Any]], payload_dir: Path | None
) -> tuple[list[float], list[int], list[dict[str, Any]]]:
    """Send every body with `CONCURRENCY` in flight; latencies, body sizes, parsed replies."""
    latencies = [0.0] * len(bodies)
    sizes = [0] * len(bodies)
    replies: list[dict[str, Any]] = [{}] * len(bodies)
    send, receive = trio.open_memory_channel[int](len(bodies))
    for index in range(len(bodies)):
        send.send_nowait(index)
    send.close()

    async def worker(client: httpx.AsyncClient) -> None:
        async for index in receive:
            body = _with_payload_dir(bodies[index], payload_dir)
            started = time.perf_counter()
            response = await client.post("/inference/v1/generate", json=body)
            response.raise_for_status()
            # Parsing is part of the cost: the orchestrator must parse every reply.
            replies[index] = response.json()
            latencies[index] = time.perf_counter() - started
            sizes[index] = len(response.content)

    limits = httpx.Limits(max_connections=CONCURRENCY)
    # No warm-up request: it would fill the prefix cache. Connection set-up is part of
    # the first requests' latency, in both modes alike.
    async with (
        httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        for _ in range(CONCURRENCY):
            nursery.start_soon(worker, client)
    return latencies, sizes, replies


def _read(payload_dir: Path, segment: dict[str, Any]) -> np.ndarray:
    count = int(np.prod(segment["shape"]))
    array = np.fromfile(
        payload_dir / segment["file"],
        dtype=np.dtype(segment["dtype"]),
        count=count,
        offset=segment["offset"],
    )
    return array.reshape(segment["shape"])


def _equal_choices(
    inline: list[dict[str, Any]], by_handle: list[dict[str, Any]], payload_dir: Path
) -> int:
    """How many requests have by-handle arrays bitwise equal to their inline arrays."""
    equal = 0
    for inline_reply, handle_reply in zip(inline, by_handle, strict=True):
        inline_choice, handle_choice = inline_reply["choices"][0], handle_reply["choices"][0]
        same = inline_choice["token_ids"] == handle_choice["token_ids"]
        for segment in handle_choice["payload"]:
            array, pos = decode_inline(inline_choice[segment["field"]], field=segment["field"])
            file_array = _read(payload_dir, segment)
            same = same and pos == segment["pos"] and file_array.dtype == array.dtype
            same = same and np.array_equal(file_array, array)
        equal += same
    return equal


async def main() -> None:
    bodies = _workload()
    results: dict[str, list[tuple[list[float], list[int]]]] = {"inline": [], "by_handle": []}
    first_replies: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-payloads-") as tmp:
        # Round 0 is the warm-up, not reported.
        payload_dirs = [Path(tmp) / f"round{number}" / "v0" for number in range(len(ROUNDS))]
        for number, mode in enumerate(ROUNDS):
            # The warm-up round goes by handle: it touches every code path of the server.
            payload_dir = payload_dirs[number] if mode != "inline" else None
            server = _Server()
            try:
                url = await trio.to_thread.run_sync(server.wait_url)
                latencies, sizes, replies = await _run_round(url, bodies, payload_dir)
            finally:
                await trio.to_thread.run_sync(server.stop)
            if mode == "warm_up":
                continue
            results[mode].append((latencies, sizes))
            first_replies.setdefault(mode, replies)
            print(
                f"round {number} {mode:9s}: mean latency "
                f"{statistics.mean(latencies):.3f} s, response bytes {sum(sizes):,}",
                flush=True,
            )
        handle_dir = payload_dirs[ROUNDS.index("by_handle")]
        file_bytes = sum(path.stat().st_size for path in handle_dir.iterdir())
        equal = _equal_choices(first_replies["inline"], first_replies["by_handle"], handle_dir)
    _report(bodies, results, file_bytes, equal)


def _report(
    bodies: list[dict[str, Any]],
    results: dict[str, list[tuple[list[float], list[int]]]],
    file_bytes: int,
    equal: int,
) -> None:
    def mean_latency(mode: str) -> list[float]:
        return [statistics.mean(latencies) for latencies, _ in results[mode]]

    inline_bytes = results["inline"][0][1]
    handle_bytes = results["by_handle"][0][1]
    inline_latency, handle_latency = mean_latency("inline"), mean_latency("by_handle")
    byte_ratio = sum(handle_bytes) / sum(inline_bytes)
    prompt_tokens = [len(body["token_ids"]) for body in bodies]
    rows = [
        "| | inline | by handle |",
        "|---|---|---|",
        f"| response bytes (16 requests) | {sum(inline_bytes) / 1e6:.2f} MB "
        f"| {sum(handle_bytes) / 1e6:.3f} MB |",
        "| mean request latency, rounds in order | "
        + " / ".join(f"{value:.3f} s" for value in inline_latency)
        + " | "
        + " / ".join(f"{value:.3f} s" for value in handle_latency)
        + " |",
        f"| mean request latency, both rounds | {statistics.mean(inline_latency):.3f} s "
        f"| {statistics.mean(handle_latency):.3f} s |",
        f"| payload file bytes on disk | 0 | {file_bytes / 1e6:.2f} MB |",
    ]
    verdict_bytes = "met" if byte_ratio <= 1 / 50 else "MISSED"
    verdict_latency = (
        "met" if statistics.mean(handle_latency) <= statistics.mean(inline_latency) else "MISSED"
    )
    markdown = "\n".join(
        [
            "## Payloads by handle vs inline",
            "",
            f"`{COMMAND}` (revision {git_revision()}), on {machine()}.",
            "",
            f"{REQUESTS} requests of {min(prompt_tokens)} to {max(prompt_tokens)} prompt "
            f"tokens (mean {statistics.mean(prompt_tokens):.0f}), max_tokens {MAX_TOKENS}, "
            f"concurrency {CONCURRENCY}, model 48 layers top-8 of 128 experts, routed experts "
            "and sampling masks requested, same seeds in both modes; one fresh local "
            "`orchestrator sim-inference` process per round (cold prefix cache), an "
            "unreported warm-up round, then rounds ordered inline, by handle, by handle, "
            "inline. Latency is measured by the "
            "client from sending to a parsed JSON reply; the simulated model adds no "
            "decode time, so it is all serving cost: routing, encoding, writing, transfer.",
            "",
            *rows,
            "",
            f"- Response bytes by handle / inline: 1/{1 / byte_ratio:.0f} "
            f"(target at most 1/50: {verdict_bytes}).",
            f"- Mean latency by handle vs inline: {verdict_latency} (target: by handle no worse).",
            f"- By-handle arrays read from the files equal the inline arrays: {equal}/{REQUESTS}.",
        ]
    )
    write_section("by_handle_vs_inline", markdown)
    print(markdown)
    print(json.dumps({"byte_ratio": byte_ratio, "equal": equal}))


if __name__ == "__main__":
    trio.run(main)
