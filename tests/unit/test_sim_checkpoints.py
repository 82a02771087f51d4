"""The local trainer's checkpoints for servers that load weights from disk: the base
folder's files, its safetensors perturbed by the version, reproducibly, its metadata kept
(transformers refuses a file without its "format")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from orchestrator.sim.checkpoints import CheckpointError, write_checkpoint


def base_model(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {
        "layer.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "layer.bias": np.zeros(8, np.float16),
        "step": np.arange(3, dtype=np.int64),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    return folder


def test_each_version_is_the_base_perturbed_reproducibly(tmp_path: Path) -> None:
    base = base_model(tmp_path / "base")
    for version in (1, 2):
        write_checkpoint(base, version, tmp_path / f"v{version}")
    write_checkpoint(base, 1, tmp_path / "again")
    original = load_file(base / "model.safetensors")
    one, two = (load_file(tmp_path / f"v{v}" / "model.safetensors") for v in (1, 2))
    assert (tmp_path / "v1" / "config.json").read_text() == '{"model_type": "qwen3"}'
    with safe_open(tmp_path / "v1" / "model.safetensors", "np") as opened:
        assert opened.metadata() == {"format": "pt"}
    for name in ("layer.weight", "layer.bias"):
        assert one[name].dtype == original[name].dtype
        assert not np.array_equal(one[name], original[name])
        assert not np.array_equal(one[name], two[name])
        assert np.array_equal(one[name], load_file(tmp_path / "again" / "model.safetensors")[name])
    # Integers are not weights.
    assert np.array_equal(one["step"], original["step"])
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_a_folder_without_safetensors_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        write_checkpoint(tmp_path / "empty", 1, tmp_path / "out")
