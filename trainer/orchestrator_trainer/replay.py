"""Router replay for Qwen3-MoE: the experts the inference server routed each token to
replace the router's own top-k, in every MoE layer.

The router still computes its softmax over all experts from its own weights, so the
gates (the weights mixing the chosen experts' outputs) and their gradients are the
trainer's; only the choice of experts is the server's. This is what prime-rl's and
Megatron's routers do with replayed ids: `top_scores = softmax(logits).gather(ids)`,
renormalised when the model normalises its top-k (`norm_topk_prob`).

A route with a negative id (the `-1` sentinel of a sample's final token) falls back to
the router's own choice for that token.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.errors import UserError


class ReplayError(UserError):
    """The model cannot replay the routes given (no MoE router, a shape that differs):
    the batch's routing is not this model's (one line)."""


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model`, in layer order: the modules named `*.mlp.gate` that
    pick `top_k` of `num_experts` (transformers' Qwen3-MoE router). Empty for a dense
    model."""
    routers = []
    for name, module in model.named_modules():
        if (
            name.endswith("mlp.gate")
            and hasattr(module, "top_k")
            and hasattr(module, "num_experts")
        ):
            routers.append(module)
    return routers


class RouterReplay:
    """Replays routes in `model`'s routers while `replaying(routes)` is entered.

    Outside it (or with `routes` None) the routers choose as they always do: the
    patched forward is then the router's own, token for token.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self._routes: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_replaying_forward(self, layer), router)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0].top_k) if self.routers else 0

    def check(self, routes: torch.Tensor) -> None:
        """Raise ReplayError unless `routes` is `[tokens, layers, top_k]` for this model."""
        if not self.routers:
            raise ReplayError("the model has no MoE router to replay routes into")
        expected = (self.layers, self.top_k)
        if routes.dim() != 3 or tuple(routes.shape[1:]) != expected:
            raise ReplayError(
                f"routes of shape {tuple(routes.shape)} do not fit the model's "
                f"{self.layers} MoE layers of top-{self.top_k}"
            )
        num_experts = int(self.routers[0].num_experts)
        if routes.numel() and int(routes.max()) >= num_experts:
            raise ReplayError(f"a route names expert {int(routes.max())} of {num_experts}")

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Replay `routes` (`[tokens, layers, top_k]`, integer; tokens in the order of the
        forward's flattened batch) in every forward inside the block."""
        if routes is not None:
            self.check(routes)
            routes = routes.to(torch.long)
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def layer_routes(self, layer: int, tokens: int) -> torch.Tensor | None:
        if self._routes is None:
            return None
        if self._routes.shape[0] != tokens:
            raise ReplayError(f"routes for {self._routes.shape[0]} tokens, forward of {tokens}")
        return self._routes[:, layer, :]


def _replaying_forward(replay: RouterReplay, layer: int):  # type: ignore[no-untyped-def]
    def forward(router: nn.Module, hidden_states: torch.Tensor):  # type: ignore[no-untyped-def]
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own_scores, own_ids = torch.topk(probs, router.top_k, dim=-1)
        routes = replay.layer_routes(layer, hidden.shape[0])
        if routes is None:
            scores, ids = own_scores, own_ids
        else:
            ids = torch.where(routes < 0, own_ids, routes)
            scores = probs.gather(1, ids)
        if router.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), ids

    return forward
