"""The policy being trained: the model, its optimizer, its router replay, its version.

Version 0 is `[model] path`; a restarted trainer starts from its last published version
instead, the optimizer state included (saved beside that version's weights).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import structlog
import torch
import transformers

from orchestrator.config import TrainConfig
from orchestrator.errors import UserError
from orchestrator_trainer.replay import RouterReplay

log = structlog.get_logger(__name__)

#: The optimizer state saved in each version's directory, for a restart from it.
TRAINER_STATE = "trainer_state.pt"


class PolicyError(UserError):
    """A model folder the trainer cannot start from (one line)."""


@attrs.define(eq=False)
class Policy:
    model: transformers.PreTrainedModel
    optimizer: torch.optim.Optimizer
    replay: RouterReplay
    version: int

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def load_policy(source: Path, version: int, train: TrainConfig, *, seed: int) -> Policy:
    """The policy of `version` from the Hugging Face folder `source`, with its optimizer
    state when the folder holds one. Raises PolicyError for a folder transformers cannot
    load."""
    if not (source / "config.json").is_file():
        raise PolicyError(f"{source} is not a Hugging Face model folder (no config.json)")
    torch.manual_seed(seed + version)
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    except (OSError, ValueError, KeyError) as exc:
        raise PolicyError(f"cannot load the model in {source}: {exc}") from None
    model.train()
    if train.trained_layers:
        freeze_below(model, train.trained_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=train.learning_rate,
        betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.weight_decay,
    )
    state_file = source / TRAINER_STATE
    if version > 0:
        if state_file.is_file():
            state = torch.load(state_file, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
        else:
            log.warning(
                "no optimizer state beside the weights: the optimizer starts afresh",
                version=version,
                folder=str(source),
            )
    return Policy(model=model, optimizer=optimizer, replay=RouterReplay(model), version=version)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (`model.layers` in transformers' Llama,
    Qwen3, Mixtral and their kin). Raises PolicyError for a model without one."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            return module
    raise PolicyError(
        f"{type(model).__name__} has no stack of decoder layers: set [train] "
        "trained_layers = 0 to train it whole"
    )


def freeze_below(model: torch.nn.Module, trained: int) -> None:
    """Leave only the top `trained` decoder layers and what follows them (the final
    norm; an untied head) with gradients: the embeddings (and a head tied to them) and
    every lower layer are frozen. Raises PolicyError when the model has fewer layers."""
    layers = decoder_layers(model)
    if trained > len(layers):
        raise PolicyError(
            f"[train] trained_layers = {trained}, but the model has {len(layers)} decoder layers"
        )
    keep = {id(p) for layer in layers[len(layers) - trained :] for p in layer.parameters()}
    below = {id(p) for layer in layers[: len(layers) - trained] for p in layer.parameters()}
    embeddings = model.get_input_embeddings()
    frozen = below | {id(p) for p in embeddings.parameters()}
    for param in model.parameters():
        if id(param) in frozen and id(param) not in keep:
            param.requires_grad_(False)
