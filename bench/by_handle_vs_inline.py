"""Payloads by handle vs inline: reply bytes, request latency and parse time on the local server.

The workload of the by-handle design's GPU measurement (docs/design.md §1): 16 requests of
500 to 8,000 prompt tokens, 256 new tokens, concurrency 8, the default model shape (48
layers, top-8 of 128 experts), the same seeds in every round. Requests are vLLM's
`GenerateRequest` as the daemon builds it (`build_generate_request`, routing from position
0, so every reply carries every routing row of its prompt and completion); routing and mask
capture are server settings, on in both servers. Three ways a turn's payload can travel:

- **prime-rl by handle**: `extra_args.payload_dir` set, the server writes one file per
  choice and replies with segments;
- **prime-rl inline**: packed base64 routing (with its `start`), CSR mask, packed logprobs;
- **upstream inline**: vLLM as released (`--reply-form upstream`): routing as a base64
  `.npy`, the mask as one JSON list of ids per completion token, logprobs as
  `logprobs.content` entries.

Two long-running `orchestrator sim-inference` processes (one per reply form; the server
keeps no state between requests that changes a reply) share the machine's cores with this
client. The client is the daemon's own: its HTTP/1.1 client (`post_generate`) and its reply
parser (`parse_generate_response`, with the model's routing shape), run in the event loop
as the daemon runs them. Latency is per request, from sending to the parsed reply; parse
time is that parser's share of it. After an unreported warm-up round per form, rounds go
by handle, prime-rl inline, upstream inline, then the reverse, twice over, so drift hits
every form alike.

After timing, every by-handle array is read back from its file and compared with both
inline forms of the same request: the figures are only worth reporting if all are equal.

Run: uv run --frozen python bench/by_handle_vs_inline.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import trio
from _report import git_revision, machine, write_section

from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import post_generate
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.payload import RoutingShape, read_segment
from orchestrator.wire import build_generate_request, parse_generate_response

COMMAND = "uv run --frozen python bench/by_handle_vs_inline.py"
REQUESTS = 16
MIN_PROMPT, MAX_PROMPT = 500, 8000
MAX_TOKENS = 256
CONCURRENCY = 8
LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128
FIELDS = ("routed_experts", "sampling_mask")
ROUTING_SHAPE = RoutingShape(LAYERS, TOP_K, NUM_EXPERTS)

# Form -> (the server's --reply-form, by handle?).
FORMS: dict[str, tuple[str, bool]] = {
    "handle": ("prime-rl", True),
    "packed": ("prime-rl", False),
    "upstream": ("upstream", False),
}
TITLES = {
    "handle": "prime-rl by handle",
    "packed": "prime-rl inline",
    "upstream": "upstream inline",
}
_BLOCK = ("handle", "packed", "upstream", "upstream", "packed", "handle")
# The warm-up rounds (page cache, imports, allocators, connections) are not reported.
ROUNDS: tuple[tuple[str, bool], ...] = (
    *((form, True) for form in FORMS),
    *((form, False) for form in _BLOCK * 2),
)


class _Round:
    """One round's figures, per request (in request order)."""

    def __init__(self, requests: int) -> None:
        self.latencies = [0.0] * requests
        self.parse_times = [0.0] * requests
        self.sizes = [0] * requests
        self.turns: list[TurnOutput | None] = [None] * requests
        self.bodies: list[bytes] = [b""] * requests


def _workload() -> list[list[int]]:
    """The 16 prompts (the same in every round; request `i` has seed `i`)."""
    rng = np.random.default_rng(2026)
    lengths = np.linspace(MIN_PROMPT, MAX_PROMPT, REQUESTS).round().astype(int)
    rng.shuffle(lengths)
    return [rng.integers(0, 32000, size=length).tolist() for length in lengths.tolist()]


class _Server:
    """An `orchestrator sim-inference` process with the default model shape, capturing
    routing and masks (the default) and answering in `reply_form`."""

    def __init__(self, reply_form: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "sim-inference",
                "--port",
                "0",
                "--reply-form",
                reply_form,
                "--layers",
                str(LAYERS),
                "--top-k",
                str(TOP_K),
                "--num-experts",
                str(NUM_EXPERTS),
            ],
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
    client: HTTP11Client, url: str, prompts: list[list[int]], payload_dir: Path | None
) -> _Round:
    """Send every request with `CONCURRENCY` in flight; time each one and its parse."""
    result = _Round(len(prompts))
    send, receive = trio.open_memory_channel[int](len(prompts))
    for index in range(len(prompts)):
        send.send_nowait(index)
    send.close()

    async def worker() -> None:
        async for index in receive:
            body = build_generate_request(
                request_id=f"bench-{index}",
                token_ids=prompts[index],
                max_tokens=MAX_TOKENS,
                seed=index,
                payload_dir=payload_dir,
                routing_start=0,
            )
            started = time.perf_counter()
            raw = await post_generate(client, url, body)
            # Parsing is part of the cost: the daemon parses every reply, in its event loop.
            parse_started = time.perf_counter()
            turn = parse_generate_response(
                raw,
                prompt_len=len(prompts[index]),
                routing_start=0,
                payload_dir=payload_dir,
                fields=FIELDS,
                routing_shape=ROUTING_SHAPE,
            )
            done = time.perf_counter()
            if turn.poisoned is not None:
                raise RuntimeError(f"request {index}: poisoned reply: {turn.poisoned}")
            result.latencies[index] = done - started
            result.parse_times[index] = done - parse_started
            result.sizes[index] = len(raw)
            result.turns[index] = turn
            result.bodies[index] = raw

    async with trio.open_nursery() as nursery:
        for _ in range(CONCURRENCY):
            nursery.start_soon(worker)
    return result


def _inline(turn: TurnOutput | None, field: str) -> tuple[np.ndarray, int]:
    assert turn is not None
    return turn.inline[field]


# The keys of a choice that carry a payload field or the logprobs, in either form.
_BREAKDOWN = {
    "routing": ("routed_experts",),
    "masks": ("sampling_mask",),
    "logprobs": ("logprobs", "completion_logprobs"),
}


def _key_bytes(bodies: Sequence[bytes]) -> dict[str, int]:
    """How many bytes of the replies' JSON the routing, the masks and the logprobs take."""
    out = dict.fromkeys(_BREAKDOWN, 0)
    for body in bodies:
        choice = json.loads(body)["choices"][0]
        for part, keys in _BREAKDOWN.items():
            out[part] += sum(
                len(json.dumps(choice[key], separators=(",", ":"))) for key in keys if key in choice
            )
    return out


def _equal_turns(rounds: dict[str, _Round], payload_dir: Path) -> int:
    """How many requests have by-handle arrays (read from their files) equal to the
    arrays of both inline forms, at the same positions, with the same tokens and logprobs."""
    equal = 0
    for handle, packed, upstream in zip(
        rounds["handle"].turns, rounds["packed"].turns, rounds["upstream"].turns, strict=True
    ):
        assert handle is not None and packed is not None and upstream is not None
        same = np.array_equal(handle.completion_ids, packed.completion_ids)
        same = same and np.array_equal(packed.completion_ids, upstream.completion_ids)
        # Upstream's logprobs are JSON numbers of the float32 values prime-rl packs.
        same = same and np.array_equal(handle.logprobs, packed.logprobs)
        same = same and np.array_equal(packed.logprobs, upstream.logprobs)
        same = same and set(handle.segments) == set(FIELDS)
        for field, segment in handle.segments.items():
            from_file = read_segment(payload_dir, segment)
            for inline, pos in (_inline(packed, field), _inline(upstream, field)):
                same = same and pos == segment.pos and np.array_equal(from_file, inline)
        equal += same
    return equal


async def main() -> None:
    prompts = _workload()
    rounds: dict[str, list[_Round]] = {form: [] for form in FORMS}
    with tempfile.TemporaryDirectory(prefix="bench-payloads-") as tmp:
        servers = {form: _Server(form) for form in ("prime-rl", "upstream")}
        payload_dirs = [Path(tmp) / f"round{number}" / "v0" for number in range(len(ROUNDS))]
        try:
            urls = {
                form: await trio.to_thread.run_sync(server.wait_url)
                for form, server in servers.items()
            }
            async with HTTP11Client() as client:
                for number, (form, warm_up) in enumerate(ROUNDS):
                    reply_form, by_handle = FORMS[form]
                    payload_dir = payload_dirs[number] if by_handle else None
                    result = await _run_round(client, urls[reply_form], prompts, payload_dir)
                    if warm_up:
                        continue
                    if rounds[form]:
                        # Only the first round's replies are compared and broken down.
                        result.turns, result.bodies = [], []
                    rounds[form].append(result)
                    print(
                        f"round {number} {TITLES[form]:18s}: median latency "
                        f"{statistics.median(result.latencies):.3f} s, "
                        f"reply bytes {sum(result.sizes):,}",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                await trio.to_thread.run_sync(server.stop)
        first_handle = next(
            number
            for number, (form, warm_up) in enumerate(ROUNDS)
            if form == "handle" and not warm_up
        )
        handle_dir = payload_dirs[first_handle]
        file_bytes = sum(path.stat().st_size for path in handle_dir.iterdir())
        equal = _equal_turns({form: results[0] for form, results in rounds.items()}, handle_dir)
    breakdown = {form: _key_bytes(rounds[form][0].bodies) for form in ("packed", "upstream")}
    _report(prompts, rounds, file_bytes, equal, breakdown)


def _mb(count: int) -> str:
    return f"{count / 1e6:.2f} MB"


def _p90(values: Sequence[float]) -> float:
    return float(np.percentile(values, 90))


def _report(
    prompts: list[list[int]],
    rounds: dict[str, list[_Round]],
    file_bytes: int,
    equal: int,
    breakdown: dict[str, dict[str, int]],
) -> None:
    def pooled(form: str, what: str) -> list[float]:
        return [value for result in rounds[form] for value in getattr(result, what)]

    def cells(render: Callable[[str], str]) -> str:
        return " | ".join(render(form) for form in FORMS)

    def median_p90(form: str, what: str) -> str:
        values = pooled(form, what)
        return f"{statistics.median(values) * 1e3:.1f} / {_p90(values) * 1e3:.1f} ms"

    reply_bytes = {form: sum(rounds[form][0].sizes) for form in FORMS}
    median_latency = {form: statistics.median(pooled(form, "latencies")) for form in FORMS}
    median_parse = {form: statistics.median(pooled(form, "parse_times")) for form in FORMS}
    total_parse = {
        form: statistics.mean(sum(result.parse_times) for result in rounds[form]) for form in FORMS
    }
    byte_ratio = reply_bytes["handle"] / reply_bytes["packed"]
    samples = len(rounds["handle"]) * REQUESTS
    rows = [
        "| | " + " | ".join(TITLES[form] for form in FORMS) + " |",
        "|---" * (len(FORMS) + 1) + "|",
        f"| reply bytes ({REQUESTS} requests) | "
        + cells(lambda form: f"{reply_bytes[form] / 1e6:.3f} MB")
        + " |",
        f"| request latency, median / p90 ({samples} requests) | "
        + cells(lambda form: median_p90(form, "latencies"))
        + " |",
        "| mean request latency, rounds in order | "
        + cells(
            lambda form: (
                " / ".join(
                    f"{statistics.mean(result.latencies) * 1e3:.0f}" for result in rounds[form]
                )
                + " ms"
            )
        )
        + " |",
        "| client parse time per reply, median / p90 | "
        + cells(lambda form: median_p90(form, "parse_times"))
        + " |",
        f"| client parse time per round of {REQUESTS} replies | "
        + cells(lambda form: f"{total_parse[form] * 1e3:.0f} ms")
        + " |",
        "| payload file bytes on disk | "
        + cells(lambda form: f"{file_bytes / 1e6:.2f} MB" if form == "handle" else "0")
        + " |",
    ]
    verdict_bytes = "met" if byte_ratio <= 1 / 50 else "MISSED"
    verdict_latency = "met" if median_latency["handle"] <= median_latency["packed"] else "MISSED"
    packed, upstream = breakdown["packed"], breakdown["upstream"]
    upstream_cost = (
        "- Upstream vLLM's inline form costs "
        f"{reply_bytes['upstream'] / reply_bytes['packed']:.2f}x the reply bytes of "
        f"prime-rl's packed form, {median_parse['upstream'] / median_parse['packed']:.2f}x "
        "its median parse time and "
        f"{median_latency['upstream'] / median_latency['packed']:.2f}x its median latency "
        f"(upstream / packed: routing `.npy` {_mb(upstream['routing'])} / "
        f"{_mb(packed['routing'])}, mask lists {_mb(upstream['masks'])} / CSR "
        f"{_mb(packed['masks'])}, `logprobs.content` {_mb(upstream['logprobs'])} / "
        f"{_mb(packed['logprobs'])})."
    )
    lengths = [len(prompt) for prompt in prompts]
    markdown = "\n".join(
        [
            "## Payloads by handle vs inline",
            "",
            f"`{COMMAND}` (revision {git_revision()}), on {machine()}.",
            "",
            f"{REQUESTS} requests of {min(lengths)} to {max(lengths)} prompt tokens (mean "
            f"{statistics.mean(lengths):.0f}), max_tokens {MAX_TOKENS}, concurrency "
            f"{CONCURRENCY}, model {LAYERS} layers top-{TOP_K} of {NUM_EXPERTS} experts, the "
            "same seeds in every round. Requests are vLLM's `GenerateRequest` as the daemon "
            "builds it, asking for routing from position 0, so every reply carries all the "
            "routing rows of its prompt and completion and the completion's sampling masks "
            "(capture is on in both servers). Three forms: prime-rl by handle (segments "
            "naming one file per choice), prime-rl inline (packed base64 routing and "
            "logprobs, CSR mask) and upstream vLLM inline (`--reply-form upstream`: `.npy` "
            "routing, one JSON list of ids per token for the mask, `logprobs.content`). Two "
            "long-running local `orchestrator sim-inference` processes (prime-rl and "
            "upstream forms) share the cores with the client; an unreported warm-up round "
            "per form, then rounds ordered by handle, prime-rl inline, upstream inline and "
            "back, twice over. The client is the daemon's: "
            "its HTTP/1.1 client and `parse_generate_response` in the event loop. Latency is "
            "per request, from sending to the parsed reply; the simulated model adds no "
            "decode time, so it is all serving cost: routing, encoding, writing, transfer, "
            "parsing. By handle, parsing reads only the segments (the trainer reads the "
            "files).",
            "",
            *rows,
            "",
            f"- Reply bytes by handle / prime-rl inline: 1/{1 / byte_ratio:.0f} "
            f"(target at most 1/50: {verdict_bytes}).",
            f"- Median latency by handle vs prime-rl inline: {verdict_latency} "
            "(target: by handle no worse).",
            upstream_cost,
            f"- By-handle arrays read from the files equal both inline forms' arrays: "
            f"{equal}/{REQUESTS}.",
        ]
    )
    write_section("by_handle_vs_inline", markdown)
    print(markdown)
    print(json.dumps({"byte_ratio": byte_ratio, "equal": equal}))


if __name__ == "__main__":
    trio.run(main)
