"""A version's directory: a whole Hugging Face checkpoint in the model's own tensor names,
`STABLE` last, the optimizer state for a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from orchestrator_trainer.checkpoints import drop_previous_state, write_version
from orchestrator_trainer.policy import TRAINER_STATE, PolicyError, load_policy
from safetensors import safe_open

from orchestrator.config import TrainConfig
from orchestrator.handoff import latest_published_version, weights_step_dir

TRAIN = TrainConfig(learning_rate=1e-2)


def inventory(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(folder / "model.safetensors", "pt") as opened:
        return {
            name: (
                str(opened.get_slice(name).get_dtype()),
                tuple(opened.get_slice(name).get_shape()),
            )
            for name in opened.keys()  # noqa: SIM118 (safe_open is no mapping)
        }


def nudge(policy) -> None:
    """One optimizer step that changes every weight."""
    loss = sum((p**2).sum() for p in policy.parameters())
    loss.backward()
    policy.optimizer.step()
    policy.optimizer.zero_grad()


@pytest.mark.parametrize("layout", ["native", "prime-rl"])
def test_a_version_is_the_model_in_its_own_tensor_names_published_last(
    tiny_moe: Path, tmp_path: Path, layout: str
) -> None:
    policy = load_policy(tiny_moe, 0, TRAIN, seed=0)
    nudge(policy)
    out = write_version(policy, tmp_path, 1, layout=layout, model_dir=tiny_moe)
    assert out == weights_step_dir(tmp_path, 1, layout=layout)
    # Per-expert names and shapes, as the base folder has them (what vLLM's loader maps).
    assert inventory(out) == inventory(tiny_moe)
    assert any(".mlp.experts.7.down_proj.weight" in name for name in inventory(out))
    for name in ("STABLE", "config.json", "tokenizer.json", "tokenizer_config.json", TRAINER_STATE):
        assert (out / name).is_file(), name
    assert latest_published_version(tmp_path, layout=layout) == 1
    again = load_policy(out, 1, TRAIN, seed=0)
    for (name, mine), (_, theirs) in zip(
        policy.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    assert (
        again.optimizer.state_dict()["state"].keys()
        == policy.optimizer.state_dict()["state"].keys()
    )


def test_a_version_cut_short_is_written_again_whole(tiny_moe: Path, tmp_path: Path) -> None:
    half = weights_step_dir(tmp_path, 1)
    half.mkdir(parents=True)
    (half / "model-00001-of-00002.safetensors").write_bytes(b"torn")
    policy = load_policy(tiny_moe, 0, TRAIN, seed=0)
    out = write_version(policy, tmp_path, 1, layout="native", model_dir=tiny_moe)
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "STABLE").is_file()


def test_only_the_newest_optimizer_state_is_kept(tiny_moe: Path, tmp_path: Path) -> None:
    policy = load_policy(tiny_moe, 0, TRAIN, seed=0)
    for step in (1, 2):
        write_version(policy, tmp_path, step, layout="native", model_dir=tiny_moe)
        drop_previous_state(tmp_path, step, layout="native")
    assert not (weights_step_dir(tmp_path, 1) / TRAINER_STATE).exists()
    assert (weights_step_dir(tmp_path, 2) / TRAINER_STATE).is_file()
    assert (weights_step_dir(tmp_path, 1) / "model.safetensors").is_file()


def test_a_folder_without_a_model_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"no config\.json"):
        load_policy(tmp_path, 0, TRAIN, seed=0)
