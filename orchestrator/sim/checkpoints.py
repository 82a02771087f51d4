"""Checkpoints a local trainer writes for servers that load weights from disk
(`[inference] weight_update = "vllm"`): version k is the base model folder with every
floating-point tensor perturbed by a function of k, in the model's own layout
(`config.json`, the safetensors files under their own names, the tokenizer files), as a
trainer saving a Hugging Face checkpoint writes it.

The perturbation is not training: it makes each version's weights different and
reproducible, so a test can tell which version a server really loaded (greedy tokens
equal what `transformers` generates from checkpoint k, and differ from k - 1).
Blocking; numpy and `safetensors` only (no torch).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from orchestrator.errors import UserError

#: Each tensor moves by this share of its own standard deviation, times a standard normal.
PERTURBATION = 0.3
_FLOATS = (np.float16, np.float32, np.float64)


class CheckpointError(UserError):
    """The base model folder cannot be turned into checkpoints (one line)."""


def perturbed(name: str, tensor: np.ndarray, version: int) -> np.ndarray:
    """`tensor` as version `version` holds it (version 0: unchanged)."""
    if version == 0 or tensor.dtype.type not in _FLOATS or not tensor.size:
        return tensor
    seed = [version, *name.encode()]
    noise = np.random.default_rng(seed).standard_normal(tensor.shape)
    scale = PERTURBATION * float(np.std(tensor)) or PERTURBATION
    return (tensor + scale * noise).astype(tensor.dtype)


def write_checkpoint(base: Path, version: int, out: Path) -> None:
    """Write version `version` of the model in `base` into the directory `out` (created):
    every file of `base` copied, its `*.safetensors` files perturbed. Each file is written
    under a temporary name and renamed, so `out` never holds a partial file.

    Raises `CheckpointError` for a folder without safetensors files, or with tensors numpy
    cannot hold (bfloat16: save the base model as float32 or float16)."""
    weights = sorted(base.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{base} has no *.safetensors files to write checkpoints from")
    out.mkdir(parents=True, exist_ok=True)
    for source in sorted(base.iterdir()):
        if not source.is_file():
            continue
        partial = out / f".{source.name}.partial"
        if source.suffix == ".safetensors":
            try:
                tensors = load_file(source)
                with safe_open(source, "np") as opened:
                    # transformers refuses a file without its "format" entry.
                    metadata = opened.metadata()
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"cannot read {source} with numpy ({exc})") from None
            changed = {name: perturbed(name, t, version) for name, t in tensors.items()}
            save_file(changed, partial, metadata=metadata)
        else:
            shutil.copyfile(source, partial)
        os.replace(partial, out / source.name)
