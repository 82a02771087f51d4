"""`moe_reload_refusal`: a `weight_update = "vllm"` run of a mixture-of-experts model is
refused against a vLLM that does not reload expert weights; anything else starts."""

from __future__ import annotations

import pytest

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
