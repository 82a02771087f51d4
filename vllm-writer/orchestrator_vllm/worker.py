"""`WeightLoader`: the vLLM worker extension (`--worker-extension-cls`) that loads a
Hugging Face checkpoint directory into the running model, mixture-of-experts layers
included. `orchestrator-vllm serve` adds it; the middleware calls its two methods on every
worker through the engine's `collective_rpc` (`middleware.py`, `POST /update_weights`).

vLLM 0.30.0's own `reload_weights` runs the model's weight loader over the checkpoint
(the start-up path, with its mapping of per-expert tensors onto the fused `w13_weight` /
`w2_weight`) inside its layerwise reload, which re-runs each layer's
`process_weights_after_loading`. For an unquantized fused-MoE layer that second run sees
the kernel already built, takes it for a weight update and skips the kernel setup: on
the CPU that setup is what pads and prepacks the expert weights into the grouped-GEMM
layout, so the new weights land in the kernel's storage unpacked, and the server computes
with weights that are neither the old nor the new (and logs them as not loaded). Here
each fused-MoE layer's kernel is dropped first, so the reload sets it up again exactly as
start-up did. Runs inside vLLM's worker process (torch and vLLM are there).
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator_vllm.checkpoints import (
    CheckpointProblem,
    Inventory,
    checkpoint_problem,
    read_inventory,
    ties_head,
)

#: The output head of a model whose head is tied to its embeddings (SmolLM2, Llama's
#: small models): a checkpoint may leave it out.
TIED_HEAD = frozenset({"lm_head.weight"})


class WeightLoader:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self.model_runner`
    is the worker's."""

    model_runner: Any
    # The checkpoint the model started from, and its tensors: read on first use, before
    # a load changes `model_config.model`.
    _orchestrator_base: str | None = None
    _orchestrator_inventory: Inventory | None = None

    def orchestrator_check_weights(self, weight_dir: str) -> str | None:
        """Why `weight_dir` cannot be loaded into this model (one line), or None. The
        model's own tensors are those of the checkpoint it started from (read once)."""
        try:
            if self._orchestrator_inventory is None:
                self._orchestrator_inventory = read_inventory(self._orchestrator_base_dir())
            tied = TIED_HEAD if ties_head(self._orchestrator_base_dir()) else frozenset()
            found = read_inventory(weight_dir)
            return checkpoint_problem(self._orchestrator_inventory, found, tied=tied)
        except CheckpointProblem as exc:
            return str(exc)

    def orchestrator_load_weights(self, weight_dir: str) -> float:
        """Load every tensor of `weight_dir` (checked first) into the model; the seconds
        it took."""
        started = time.perf_counter()
        self._orchestrator_base_dir()  # the start-up folder, recorded before it changes
        model = self.model_runner.get_model()
        for module in model.modules():
            method: Any = getattr(module, "quant_method", None)
            if getattr(method, "moe_kernel", None) is not None:
                # Set up again as at start-up (module docstring).
                method.moe_kernel = None
        self.model_runner.reload_weights(weights_path=weight_dir)
        return time.perf_counter() - started

    def _orchestrator_base_dir(self) -> str:
        if self._orchestrator_base is None:
            self._orchestrator_base = str(self.model_runner.model_config.model)
        return self._orchestrator_base
