"""The reference trainer's tests (`make test-trainer`, and first in `make test-vllm`): they
need torch and transformers, which the daemon's environment does not have, so they run in
the real-vLLM stage's venv with the trainer installed (`tests/vllm/run.sh trainer`).

`tiny_moe` is a tiny Qwen3 mixture-of-experts with random weights, the stage's shape
(tests/vllm/tiny_moe.py's builder), saved once per session with the demo's tokenizer;
`tiny_mixtral` the same shape as a Mixtral (router replay's other family).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import tiny_moe as builder  # noqa: E402


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-moe") / "model"
    builder.build(folder, ROOT / "demo" / "model")
    return folder


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mixtral") / "model"
    builder.build(folder, ROOT / "demo" / "model", kind="mixtral")
    return folder
