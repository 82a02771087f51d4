"""A policy that learns through the loop (`make demo-learn`, configs/learn.toml): the
learning curve, the eval before and after, the reference trainer's seconds per step and
its share of a step, the on-policy training-inference mismatch with and without router
replay (float32 server, and a bfloat16 server against the float32 trainer), and the
seconds of one `/update_weights` load on the tiny MoE against its dense twin.

Real vLLM (the CPU build of the real-vLLM stage, `tests/vllm`) through
`orchestrator-vllm serve`, the daemon, `orchestrator-trainer`; the runs are
tests/vllm/learning_run.py's. Run: uv run --frozen python bench/learning.py (installs the
stage's venv and the trainer if needed; skipped with a line where it cannot).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from _report import git_revision, machine, write_section  # noqa: E402
from vllm_by_handle import ensure_venv  # noqa: E402

LOADS = 3


def weight_load_seconds(kind: str, work: Path) -> list[float]:
    """`load_s` of LOADS `/update_weights` calls of perturbed checkpoints of the tiny
    model of `kind`, served by orchestrator-vllm."""
    from _vllm_kit import install_writer, tiny_model, vllm_server

    from orchestrator.sim.checkpoints import write_checkpoint

    model = tiny_model(kind)
    install_writer()
    root = work / f"payloads-{kind}"
    root.mkdir()
    seconds = []
    with vllm_server(
        model, work / kind, "--enforce-eager", routing=kind == "moe", writer_root=root
    ) as server:
        for version in range(1, LOADS + 1):
            checkpoint = work / kind / f"step_{version}"
            write_checkpoint(model, version, checkpoint)
            answer = httpx.post(
                f"{server.url}/update_weights", json={"weight_dir": str(checkpoint)}, timeout=300
            )
            answer.raise_for_status()
            seconds.append(float(answer.json()["load_s"]))
    return seconds


def step_intervals(run_dir: Path) -> list[float]:
    times = [
        json.loads(line)["time"] for line in (run_dir / "steps.jsonl").read_text().splitlines()
    ]
    return [b - a for a, b in itertools.pairwise(times)]


def main() -> int:
    if not ensure_venv():
        print("bench learning: skipped: the real-vLLM stage's venv cannot be installed here")
        return 0
    import os

    python = os.environ["ORCH_VLLM_PYTHON"]
    subprocess.run(
        [sys.executable, str(ROOT / "tests/vllm/install_trainer.py"), python],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    from learning_run import ENDS, MARGIN, learning_run

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        curve = learning_run(work / "learn")
        intervals = step_intervals(work / "learn")
        bf16 = learning_run(
            work / "bf16",
            "max_steps=4",
            "train.learning_rate=1e-5",
            "eval.eval_base_model=false",
            "eval.num_examples=1",
            server_flags=("--dtype=bfloat16",),
        )
        moe = weight_load_seconds("moe", work)
        dense = weight_load_seconds("dense", work)
    rows = "\n".join(
        f"| {step} | {reward:.3f} |"
        for step, reward in enumerate(curve.rewards, start=1)
        if step % 5 == 0 or step == 1
    )
    measured = [kl for kl in curve.mismatch if kl is not None]
    measured_nr = [kl for kl in curve.mismatch_no_replay if kl is not None]
    pairs = [
        (w, wo)
        for w, wo in zip(bf16.mismatch, bf16.mismatch_no_replay, strict=True)
        if w is not None and wo is not None
    ]
    step_s = statistics.fmean(intervals) if intervals else float("nan")
    verdict = "Learned" if curve.learned else "Did NOT learn"
    bf16_pairs = ", ".join(f"{w:.1e} with replay / {wo:.1e} without" for w, wo in pairs)
    markdown = f"""## A policy that learns (`make demo-learn`, `bench/learning.py`)

Machine: {machine()}. Commit {git_revision()}. vLLM 0.30.0, CPU build, eager, through
`orchestrator-vllm serve` (routing by handle, each version loaded through `/update_weights`);
the tiny Qwen3-MoE (2 layers, top-2 of 8 experts, hidden 64, random weights, float32);
configs/learn.toml: {len(curve.rewards)} steps of 32 samples (4 groups of 8), on-policy
(`max_async_steps = 0`), the reward the share of digits in the completion, learning rate
1.5e-3, router replay on.

| step | mean reward of the batch |
|---:|---:|
{rows}

- Mean reward, first {ENDS} steps: {curve.first:.3f}; last {ENDS}: {curve.last:.3f}. Eval
  (held-out questions, 32 x 2): version 0 {curve.eval_before:.3f}, last version
  {curve.eval_after:.3f}. {verdict} (margin {MARGIN} on both).
- The trainer: {curve.seconds_per_step:.2f} s per step (read, forward and backward of 32
  samples, a second forward without replay, the checkpoint), of {step_s:.2f} s between two
  shipped batches: {curve.seconds_per_step / step_s:.0%} of a step.
- On-policy mismatch KL, float32 server, float32 trainer: median
  {statistics.median(measured):.2e} with replay, {statistics.median(measured_nr):.2e} without,
  over the {len(measured)} steps with on-policy samples (both sides choose the same experts).
- bfloat16 server, float32 trainer, {len(pairs)} steps: {bf16_pairs}.
- `/update_weights` of a full checkpoint, {LOADS} loads each: MoE {statistics.median(moe):.3f} s
  (median; {", ".join(f"{s:.3f}" for s in moe)}), the dense twin {statistics.median(dense):.3f} s
  ({", ".join(f"{s:.3f}" for s in dense)}).
"""
    write_section("learning", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
