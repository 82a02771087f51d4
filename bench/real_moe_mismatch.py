"""The pretrained MoE, a bfloat16 server and a float32 trainer: how often the trainer's own
router would choose other experts than the server did, and the on-policy mismatch with
and without router replay (issue 54, item 4; the R3 paper, arXiv 2510.11370, reports
about 10% of router decisions and 94% of tokens on Qwen3-30B-A3B, and a KL about 2x
lower with replay).

The model is SmolLM2-135M-Instruct upcycled to a Mixtral (4 experts top-2, 30 layers;
`orchestrator_trainer.pretrained`, built once into the stage's cache). One
`orchestrator-vllm serve` of it in bfloat16, routing captured from position 0; each
round sends the same chat prompts (arithmetic questions) at once, temperature 1, a seed
per request, 32 new tokens. For each sample, transformers in float32 with the reference
trainer's router replay (`tiny_moe.py` `mismatch` job) gives the router's own top-k of
every (position, layer) and the completion's logprobs with and without the server's
routes replayed. Reported per round: the share of (position, layer) rows whose expert
set differs, the share of positions with such a row in any layer, and the mismatch KL
(`r - log r - 1` per completion token, prime-rl's estimator, as `trainer.jsonl`'s
`mismatch_kl`) with and without replay. No training: every round is version 0's
weights, so every sample is on-policy.

Run: uv run --frozen python bench/real_moe_mismatch.py (installs the stage's venv and
the trainer if needed; skipped with a line where the venv or the wheel cannot be had).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from _report import git_revision, machine, write_section  # noqa: E402

from orchestrator.wire import build_generate_request, parse_generate_response  # noqa: E402

ROUNDS = 2
PROMPTS = 8
NEW_TOKENS = 32


def ensure_venv() -> bool:
    if not os.environ.get("ORCH_VLLM_PYTHON"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "vllm" / "vllm_env.py"), "ensure"],
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return False
        os.environ["ORCH_VLLM_PYTHON"] = done.stdout.strip()
    install = [sys.executable, str(ROOT / "tests" / "vllm" / "install_trainer.py")]
    subprocess.run(
        [*install, os.environ["ORCH_VLLM_PYTHON"]], check=True, stdout=subprocess.DEVNULL
    )
    return True


def questions() -> list[list[dict[str, str]]]:
    rng = np.random.default_rng(54)
    pairs = rng.integers(2, 99, size=(PROMPTS, 2))
    return [
        [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        for a, b in pairs
    ]


def kl(server: np.ndarray, trainer: np.ndarray) -> float:
    """prime-rl's mismatch estimator, mean over tokens: r - log r - 1, r = p_train/p_infer."""
    d = trainer - server
    return float(np.mean(np.expm1(d) - d))


def main() -> int:
    if not ensure_venv():
        print("real_moe_mismatch: skipped: the pinned vLLM cannot be installed here")
        return 0
    from _vllm_kit import (
        RealModelUnavailable,
        generate,
        install_writer,
        real_model,
        reference,
        vllm_server,
    )

    from orchestrator.tasks.chat import ChatTokenizer

    try:
        model = real_model("moe")
    except RealModelUnavailable as exc:
        print(f"real_moe_mismatch: skipped: {exc}")
        return 0
    install_writer()
    tokenizer = ChatTokenizer.load(model)
    prompts = [tokenizer.render_prompt(q).tolist() for q in questions()]
    rows: list[str] = []
    totals: dict[str, list[float]] = {"rows": [], "tokens": [], "with": [], "without": []}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "payloads"
        root.mkdir()
        flags = ("--enforce-eager", "--no-enable-prefix-caching", "--dtype=bfloat16")
        started = time.monotonic()
        with vllm_server(model, Path(scratch) / "logs", *flags, writer_root=root) as server:
            ready_s = time.monotonic() - started
            print(f"bfloat16 server ready in {ready_s:.0f} s", flush=True)
            for round_ in range(ROUNDS):

                def sample(index: int, prompt: list[int], round_: int = round_) -> tuple:
                    body = build_generate_request(
                        request_id=f"mismatch-{round_}-{index}",
                        token_ids=prompt,
                        seed=1000 * round_ + index,
                        payload_dir=None,
                        routing_start=0,
                        max_tokens=NEW_TOKENS,
                    )
                    body["sampling_params"]["temperature"] = 1.0
                    reply = generate(server, body)
                    assert reply.status_code == 200, reply.text
                    turn = parse_generate_response(
                        reply.content,
                        prompt_len=len(prompt),
                        routing_start=0,
                        payload_dir=None,
                        fields=("routed_experts",),
                    )
                    routes, _ = turn.inline["routed_experts"]
                    tokens = prompt + turn.completion_ids.tolist()
                    return tokens, len(prompt), routes, turn.logprobs

                # All of a round's requests at once: the server batches them.
                with ThreadPoolExecutor(len(prompts)) as pool:
                    samples = list(pool.map(sample, range(len(prompts)), prompts))
                job = {
                    "mismatch": [
                        {"tokens": t, "start": s, "routes": r[: len(t) - 1].tolist()}
                        for t, s, r, _ in samples
                    ]
                }
                answers = reference(model, job)["mismatch"]
                differ_rows, rows_n, differ_tokens, tokens_n = 0, 0, 0, 0
                server_lp, own_lp, replay_lp = [], [], []
                for (tokens, _, routes, logprobs), answer in zip(samples, answers, strict=True):
                    served = np.sort(routes[: len(tokens) - 1], axis=-1)
                    own = np.sort(np.asarray(answer["experts"]), axis=-1)
                    differs = (served != own).any(axis=-1)  # [positions, layers]
                    differ_rows += int(differs.sum())
                    rows_n += differs.size
                    differ_tokens += int(differs.any(axis=-1).sum())
                    tokens_n += differs.shape[0]
                    server_lp.append(np.asarray(logprobs, dtype=np.float64))
                    own_lp.append(np.asarray(answer["logprobs"]))
                    replay_lp.append(np.asarray(answer["logprobs_replay"]))
                server_all = np.concatenate(server_lp)
                with_replay = kl(server_all, np.concatenate(replay_lp))
                without = kl(server_all, np.concatenate(own_lp))
                totals["rows"].append(differ_rows / rows_n)
                totals["tokens"].append(differ_tokens / tokens_n)
                totals["with"].append(with_replay)
                totals["without"].append(without)
                rows.append(
                    f"| {round_ + 1} | {len(samples)} | {server_all.size:,} "
                    f"| {differ_rows / rows_n:.1%} | {differ_tokens / tokens_n:.1%} "
                    f"| {with_replay:.2e} | {without:.2e} | {without / with_replay:.1f}x |"
                )
                print(rows[-1], flush=True)
    markdown = "\n".join(
        [
            "## The pretrained MoE: a bfloat16 server against the float32 trainer "
            "(`bench/real_moe_mismatch.py`)",
            "",
            f"Machine: {machine()} (2-core AMD EPYC, shared with other jobs at the time). "
            f"Commit {git_revision()}. vLLM 0.30.0, CPU build, eager, bfloat16; the trainer "
            "side is transformers 5.25 in float32 with the reference trainer's router replay.",
            "SmolLM2-135M-Instruct upcycled to a Mixtral (4 experts top-2, 30 layers, 374M; "
            f"`orchestrator_trainer.pretrained`). Per round: {PROMPTS} arithmetic chat prompts, "
            f"temperature 1, {NEW_TOKENS} new tokens, version 0's weights (every sample "
            f"on-policy). The server was ready in {ready_s:.0f} s.",
            "",
            "Rows: (position, layer) pairs of prompt and completion whose expert set the "
            "trainer's own router would choose otherwise; tokens: positions with such a row "
            "in any layer. KL: `r - log r - 1` over completion tokens, as `trainer.jsonl`'s "
            "`mismatch_kl` (with replay) and `mismatch_kl_no_replay`.",
            "",
            "| round | samples | completion tokens | rows routed otherwise | tokens routed "
            "otherwise (any layer) | mismatch KL, replay | mismatch KL, no replay | ratio |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Median over the rounds: {statistics.median(totals['rows']):.1%} of rows, "
            f"{statistics.median(totals['tokens']):.1%} of tokens routed otherwise; the KL "
            f"{statistics.median(totals['with']):.2e} with replay against "
            f"{statistics.median(totals['without']):.2e} without.",
        ]
    )
    write_section("real-moe-mismatch", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
