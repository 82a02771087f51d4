"""Where one step of the reference trainer goes on a real model: forward, backward,
optimizer and checkpoint write (the phases its `trainer.jsonl` records), for the
`[train]` settings that cut them (`autocast`, `micro_batch_tokens`, `trained_layers`).

Run with the python of the real-vLLM stage's venv (torch, transformers and the trainer
installed; tests/vllm/run.sh installs them):

    $ORCH_VLLM_PYTHON bench/trainer_step.py MODEL_DIR [--samples 32] [--prompt 45]
        [--completion 16] [--steps 3]

A synthetic batch of the learning demo's shape (`--samples` rollouts of a `--prompt`
token prompt and up to `--completion` generated tokens, lengths spread like a real
batch's) goes through `train_step` and `write_version` `--steps` times per setting; the
median of each phase is printed, one line per setting. The model's own tokens are
random ids: the cost of a step does not depend on which.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from orchestrator_trainer.checkpoints import write_version
from orchestrator_trainer.policy import load_policy
from orchestrator_trainer.steps import train_step

from orchestrator import Batch, SampleArrays
from orchestrator.config import TrainConfig

SETTINGS: dict[str, dict[str, object]] = {
    "float32, whole model, one sample per forward": {},
    "float32, whole model, micro-batches of 1024 tokens": {"micro_batch_tokens": 1024},
    "float32, micro-batches, top 8 of 30 layers": {
        "micro_batch_tokens": 1024,
        "trained_layers": 8,
    },
    "bfloat16 autocast, micro-batches, top 8 layers": {
        "autocast": "bfloat16",
        "micro_batch_tokens": 1024,
        "trained_layers": 8,
    },
}


def synthetic_batch(vocab: int, samples: int, prompt: int, completion: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    arrays = []
    for index in range(samples):
        generated = int(rng.integers(2, completion + 1))
        length = prompt + generated
        loss_mask = np.zeros(length, dtype=np.bool_)
        loss_mask[prompt:] = True
        advantage = float(rng.normal())
        arrays.append(
            SampleArrays(
                group_id=f"g{index // 8}",
                rollout_id=f"r{index}",
                start_version=0,
                dispatch_version=0,
                reward=0.0,
                advantage=advantage,
                length=length,
                rows=range(length),
                token_ids=rng.integers(0, vocab, length).astype(np.int32),
                loss_mask=loss_mask,
                advantages=np.where(loss_mask, advantage, 0).astype(np.float32),
                logprobs=np.where(loss_mask, -2.0, 0).astype(np.float32),
                routed_experts=None,
                sampling_mask=None,
            )
        )
    return Batch(step=1, created_at=time.time(), samples=arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=45)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="run the settings whose name has this")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model.name}")
    for name, keys in SETTINGS.items():
        if args.only not in name:
            continue
        train = TrainConfig(learning_rate=1e-6, **keys)  # type: ignore[arg-type]
        policy = load_policy(args.model, 0, train, seed=0)
        vocab = policy.model.config.vocab_size
        phases: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as weights:
            for step in range(1, args.steps + 1):
                batch = synthetic_batch(vocab, args.samples, args.prompt, args.completion, step)
                record = train_step(policy, batch, train)
                clock = time.monotonic()
                write_version(policy, Path(weights), step, layout="native", model_dir=args.model)
                checkpoint = time.monotonic() - clock
                policy.version = step
                for phase, seconds in (
                    ("forward", record.forward_s),
                    ("backward", record.backward_s),
                    ("optimizer", record.optimizer_s),
                    ("checkpoint", checkpoint),
                ):
                    phases.setdefault(phase, []).append(seconds)
        medians = {phase: statistics.median(values) for phase, values in phases.items()}
        shown = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in medians.items())
        print(f"{name}: {sum(medians.values()):.2f} s ({shown})", flush=True)


if __name__ == "__main__":
    main()
