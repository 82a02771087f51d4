"""The demo's config (`configs/demo.toml`) for the tests that run it, in every suite.

On `sys.path` through pytest's `pythonpath` (pyproject.toml): the tests run with
`--import-mode=importlib`, which puts no test folder there.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo.toml"
DEMO_MODEL = ROOT / "demo" / "model"
DEMO_DATA = ROOT / "demo" / "data"


def demo_paths(run_dir: Path, *, model: Path = DEMO_MODEL) -> list[str]:
    """Overrides of the demo's config that put its run in `run_dir` and name its tokenizer
    (`model`) and its datasets by absolute path: the config's relative paths resolve
    against the current directory, which a test may change."""
    return [
        f'run_dir="{run_dir}"',
        f'model.tokenizer="{model}"',
        f'env.0.dataset="{DEMO_DATA / "arith.jsonl"}"',
        f'env.1.dataset="{DEMO_DATA / "chat.jsonl"}"',
        f'eval.env.0.dataset="{DEMO_DATA / "arith_eval.jsonl"}"',
    ]


def small_demo_config(run_dir: Path, *overrides: str) -> Config:
    """The demo in `run_dir`, smaller: half its batches and rollouts in flight (16, 32),
    8 eval examples, two reward workers, a quick local trainer; `overrides` last."""
    return load_config(
        DEMO_CONFIG,
        [
            *demo_paths(run_dir),
            "eval.num_examples=8",
            "batch.size=8",
            "inference.max_inflight=16",
            "rewards.workers=2",
            "sim.train_time_s=0.05",
            "trainer.poll_interval_s=0.1",
            *overrides,
        ],
    )
