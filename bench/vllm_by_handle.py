"""Payloads by handle from upstream vLLM: reply bytes and latency, `orchestrator-vllm serve`
against the same server answering inline, on a real vLLM (the CPU build of the real-vLLM
stage, `tests/vllm`).

The model has a real MoE's routing shape (48 layers, top-8 of 128 experts, as
Qwen3-30B-A3B) on the stage's tiny hidden size, random weights (`tiny_moe.py
build-wide`). One server runs the writer; each request is sent twice, the same seed and
prompt, once with `extra_args.payload_dir` (by handle) and once without (vLLM answers
inline: routing as base64 `.npy`), alternating which goes first, with the prefix cache off
so that both are computed whole. Requests are the daemon's
(`build_generate_request`, routing from position 0), one at a time, 64 new tokens at
temperature 1. Latency is from sending to the whole reply; bytes are the reply's body.
Every by-handle file is read back and compared with the inline rows of the same request.

Run: uv run --frozen python bench/vllm_by_handle.py (installs the stage's venv if
needed; skipped with a line where it cannot be installed).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from _report import git_revision, machine, write_section  # noqa: E402
from payload_gc import PayloadRootFiles  # noqa: E402

from orchestrator.payload import read_rows  # noqa: E402
from orchestrator.wire import build_generate_request, parse_generate_response  # noqa: E402

PROMPTS = (512, 2048, 4096)
REQUESTS = 4
NEW_TOKENS = 64
MAX_LEN = 4608


def ensure_venv() -> bool:
    if os.environ.get("ORCH_VLLM_PYTHON"):
        return True
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm" / "vllm_env.py"), "ensure"],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return False
    os.environ["ORCH_VLLM_PYTHON"] = done.stdout.strip()
    return True


def request(prompt: list[int], seed: int, payload_dir: Path | None) -> dict:
    body = build_generate_request(
        request_id=f"bench-{seed}",
        token_ids=prompt,
        seed=seed,
        payload_dir=payload_dir,
        routing_start=0,
        max_tokens=NEW_TOKENS,
    )
    body["sampling_params"]["temperature"] = 1.0
    body["sampling_params"]["ignore_eos"] = True  # every completion NEW_TOKENS long
    return body


def main() -> int:
    if not ensure_venv():
        print("vllm_by_handle: skipped: the pinned vLLM cannot be installed here")
        return 0
    from _vllm_kit import generate, install_writer, tiny_model, vllm_server

    install_writer()
    model = tiny_model("wide")
    rows_out: list[str] = []
    total = {"inline": 0, "handle": 0, "files": 0}
    checked = 0
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "payloads"
        root.mkdir()
        payload_dir = root / "v0"
        # No prefix cache: every request is computed whole, so by handle and inline pay
        # the same prefill, and a cache hit cannot change near-tie routing between them.
        flags = ("--enforce-eager", "--no-enable-prefix-caching", f"--max-model-len={MAX_LEN}")
        flags += (f"--max-num-batched-tokens={MAX_LEN}",)
        with vllm_server(model, Path(scratch) / "logs", *flags, writer_root=root) as server:
            generate(server, request(list(range(3, 67)), 0, None))  # warm-up
            for length in PROMPTS:
                rng = np.random.default_rng(length)
                prompt = [int(t) for t in rng.integers(3, 1000, length)]
                sizes: dict[str, list[int]] = {"inline": [], "handle": []}
                seconds: dict[str, list[float]] = {"inline": [], "handle": []}
                files = 0
                for seed in range(REQUESTS):
                    order = ("inline", "handle") if seed % 2 == 0 else ("handle", "inline")
                    replies = {}
                    for how in order:
                        where = payload_dir if how == "handle" else None
                        started = time.perf_counter()
                        reply = generate(server, request(prompt, seed, where))
                        seconds[how].append(time.perf_counter() - started)
                        assert reply.status_code == 200, reply.text
                        sizes[how].append(len(reply.content))
                        replies[how] = parse_generate_response(
                            reply.content,
                            prompt_len=length,
                            routing_start=0,
                            payload_dir=where,
                            fields=("routed_experts",),
                        )
                    want, _ = replies["inline"].inline["routed_experts"]
                    segment = replies["handle"].segments["routed_experts"]
                    with PayloadRootFiles(root) as opened:
                        got = read_rows(opened.version(0), segment, 0, segment.rows)
                    assert np.array_equal(got, want), "by-handle rows differ from inline"
                    checked += 1
                    files += segment.rows * segment.row_nbytes
                inline_b, handle_b = (
                    statistics.mean(sizes["inline"]),
                    statistics.mean(sizes["handle"]),
                )
                total["inline"] += sum(sizes["inline"])
                total["handle"] += sum(sizes["handle"])
                total["files"] += files
                rows_out.append(
                    f"| {length:,} | {inline_b / 1024:,.1f} KiB | {handle_b / 1024:,.1f} KiB "
                    f"| {inline_b / handle_b:,.0f}x | {files / REQUESTS / 1024:,.1f} KiB "
                    f"| {statistics.median(seconds['inline']) * 1000:,.0f} ms "
                    f"| {statistics.median(seconds['handle']) * 1000:,.0f} ms |"
                )
                print(rows_out[-1], flush=True)
    n = len(PROMPTS) * REQUESTS
    markdown = "\n".join(
        [
            "## Payloads by handle from upstream vLLM (`orchestrator-vllm serve`)",
            "",
            f"Machine: {machine()}. Commit {git_revision()}. vLLM 0.30.0, CPU build, eager;",
            "the tiny model with a real MoE's routing shape (48 layers, top-8 of 128 experts).",
            f"{REQUESTS} requests per prompt length, {NEW_TOKENS} new tokens, one at a time, each",
            "sent by handle and inline with the same seed (`bench/vllm_by_handle.py`).",
            "",
            "| prompt tokens | inline reply | by-handle reply | ratio | file per request "
            "| inline latency (median) | by-handle latency (median) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            *rows_out,
            "",
            f"Over all {n} requests: {total['inline'] / 2**20:,.2f} MiB of replies inline, "
            f"{total['handle'] / 2**20:,.2f} MiB by handle, plus "
            f"{total['files'] / 2**20:,.2f} MiB written to files. "
            f"All {checked} by-handle files held exactly the inline rows.",
        ]
    )
    write_section("vllm-by-handle", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
