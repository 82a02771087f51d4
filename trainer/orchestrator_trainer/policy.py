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
