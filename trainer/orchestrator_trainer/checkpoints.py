"""A version's directory written whole, `STABLE` last.

`<weights_dir>/<step dir>/` (the run's `[trainer] weights_layout`: `step_000007` or
prime-rl's `step_7`) gets the full Hugging Face checkpoint (`config.json`, the safetensors
files under the model's own tensor names, per expert for a mixture of experts, as
`save_pretrained` writes them), the tokenizer files of `[model] path` (so the folder is a
model of its own), the optimizer state for a restart, then the hand-off's `model.json`
and `STABLE` (`orchestrator.handoff.publish_weights`). Every file is fsynced before
`STABLE` is written, so a version that is published is whole on disk; a directory
without it (a crash mid-write) is the trainer's own, and is written again from scratch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from orchestrator.handoff import StepLayout, publish_weights, weights_step_dir
from orchestrator_trainer.policy import TRAINER_STATE, Policy

#: Files of the model folder a checkpoint does not copy: the weights are the trainer's.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WRITTEN_BY_SAVE = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def write_version(
    policy: Policy, weights_dir: Path, step: int, *, layout: StepLayout, model_dir: Path
) -> Path:
    """Write and publish version `step` of `policy`; return its directory."""
    out = weights_step_dir(weights_dir, step, layout=layout)
    if out.exists():
        # Not published (the trainer only writes the version after the last published
        # one): what a crash left half-written.
        shutil.rmtree(out)
    out.mkdir(parents=True)
    policy.model.save_pretrained(out)
    for source in sorted(model_dir.iterdir()):
        if source.is_file() and not _is_weights(source.name):
            target = out / source.name
            if not target.exists():
                shutil.copyfile(source, target)
    state = {"optimizer": policy.optimizer.state_dict(), "version": step}
    torch.save(state, out / TRAINER_STATE)
    for written in out.iterdir():
        _fsync(written)
    publish_weights(weights_dir, step, layout=layout)
    return out


def drop_previous_state(weights_dir: Path, step: int, *, layout: StepLayout) -> None:
    """Remove the optimizer state of version `step - 1` once `step` is published: only
    the newest is needed for a restart, and each is twice the weights in size."""
    if step < 2:
        return
    previous = weights_step_dir(weights_dir, step - 1, layout=layout) / TRAINER_STATE
    previous.unlink(missing_ok=True)


def _is_weights(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WRITTEN_BY_SAVE


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
