"""`moe_reload_refusal`: a `weight_update = "vllm"` run of a mixture-of-experts model is
refused against a vLLM that does not reload expert weights; anything else starts. Whether
the model is one (`is_moe`) is read off the run's config and its model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config import Config, ModelConfig, PayloadConfig, SimConfig
from orchestrator.daemon.startup import is_moe
from orchestrator.wire import MOE_RELOAD_BROKEN, WEIGHT_UPDATES, WeightUpdate, moe_reload_refusal


@pytest.mark.parametrize("version", ["0.30.0", "0.30.0+cu129", " 0.30.0"])
def test_a_moe_run_against_a_broken_vllm_is_refused_with_the_fix(version: str) -> None:
    refusal = moe_reload_refusal("vllm", ["0.31.0", version], moe=True)
    assert refusal is not None
    assert "\n" not in refusal
    assert "orchestrator-vllm serve" in refusal
    assert 'weight_update = "prime-rl"' in refusal
    assert 'weight_update = "none"' in refusal
    assert version.strip() in refusal


def test_the_broken_releases_include_the_one_found() -> None:
    assert "0.30.0" in MOE_RELOAD_BROKEN


@pytest.mark.parametrize(
    "versions", [[], ["0.29.2"], ["0.30.1"], ["0.30.0rc1"], ["0.0.0+sim"], ["10.30.0"]]
)
def test_other_versions_start(versions: list[str]) -> None:
    assert moe_reload_refusal("vllm", versions, moe=True) is None


def test_a_dense_model_starts_against_a_broken_vllm() -> None:
    assert moe_reload_refusal("vllm", ["0.30.0"], moe=False) is None


@pytest.mark.parametrize("protocol", [p for p in WEIGHT_UPDATES if p != "vllm"])
@pytest.mark.parametrize("moe", [True, False])
def test_other_protocols_start_against_a_broken_vllm(protocol: WeightUpdate, moe: bool) -> None:
    assert moe_reload_refusal(protocol, ["0.30.0"], moe=moe) is None


@pytest.mark.parametrize(
    ("model_config", "moe"),
    [
        ({"model_type": "qwen3_moe", "num_experts": 128}, True),
        ({"model_type": "deepseek_v3", "n_routed_experts": 256}, True),
        ({"model_type": "mixtral", "num_local_experts": 8}, True),
        ({"model_type": "qwen3"}, False),
        ({"model_type": "qwen3_moe", "num_experts": 0}, False),
        (None, False),
    ],
)
def test_a_model_folder_tells_a_mixture_of_experts(
    tmp_path: Path, model_config: dict[str, object] | None, moe: bool
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    if model_config is not None:
        (folder / "config.json").write_text(json.dumps(model_config))
    # Routing not requested: only the folder can tell.
    config = Config(
        run_dir=tmp_path / "run",
        sim=SimConfig(inference_servers=1),
        payload=PayloadConfig(fields=()),
        model=ModelConfig(path=folder),
    )
    assert is_moe(config) is moe
    assert config.model.tokenizer == folder
