"""Router replay for mixture-of-experts families: the experts the inference server routed
each token to replace the router's own top-k, in every MoE layer.

The families it knows (`FAMILIES`, by the config's `model_type`): Qwen3-MoE (`qwen3_moe`)
and Mixtral (`mixtral`, which the upcycled SmolLM2 is). Their routers in transformers 5
are the module `model.layers.N.mlp.gate` whose forward takes the hidden states and
returns `(router_logits, top-k scores, top-k ids)`; they differ in where the experts'
count is in the config, whether the top-k scores are renormalised (Qwen3-MoE:
`norm_topk_prob`; Mixtral: always) and the scores' dtype (Qwen3-MoE casts them to the
logits' dtype; Mixtral keeps float32). The routing shape (MoE layers, experts, top-k) is
read from the config (`routing_shape`), and the routers found must match it. A config
that names experts but whose family is not here is refused in one line: replaying a
router whose rule is not known would train a policy other than the one served.

The router still computes its softmax over all experts from its own weights, so the
gates (the weights mixing the chosen experts' outputs) and their gradients are the
trainer's; only the choice of experts is the server's. This is what prime-rl's and
Megatron's routers do with replayed ids: `top_scores = softmax(logits).gather(ids)`,
renormalised where the family normalises its top-k.

A route with a negative id (the `-1` sentinel of a sample's final token) falls back to
the router's own choice for that token.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.errors import UserError


class ReplayError(UserError):
    """The model cannot replay the routes given (no MoE router, a shape that differs):
    the batch's routing is not this model's (one line)."""


#: Config keys that say a model is a mixture of experts, whatever its family.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@attrs.frozen
class Family:
    """How a family's config and router read: the config key of the experts' count,
    its MoE layers, and whether its router renormalises the top-k scores and casts
    them to the logits' dtype."""

    experts_key: str
    moe_layers: Callable[[Any], list[int]]
    normalises: Callable[[Any], bool]
    casts_scores: bool


def _every_layer(config: Any) -> list[int]:
    return list(range(config.num_hidden_layers))


def _qwen3_moe_layers(config: Any) -> list[int]:
    # transformers' Qwen3MoeDecoderLayer: an MoE block unless listed as MLP-only, every
    # `decoder_sparse_step`-th layer.
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
    layers = range(config.num_hidden_layers)
    return [i for i in layers if i not in dense and (i + 1) % step == 0]


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        experts_key="num_experts",
        moe_layers=_qwen3_moe_layers,
        normalises=lambda config: bool(config.norm_topk_prob),
        casts_scores=True,
    ),
    "mixtral": Family(
        experts_key="num_local_experts",
        moe_layers=_every_layer,
        normalises=lambda config: True,
        casts_scores=False,
    ),
}


@attrs.frozen
class RoutingShape:
    """A model's routing: its MoE layers (indices among all layers), each picking
    `top_k` of `experts`; how its routers score (`family`)."""

    family: Family
    layers: tuple[int, ...]
    experts: int
    top_k: int
    normalises: bool


def routing_shape(config: Any) -> RoutingShape | None:
    """The routing shape `config` (a transformers config) describes; None for a dense
    model. Raises ReplayError (one line) for a mixture of experts of a family not in
    `FAMILIES`."""
    model_type = getattr(config, "model_type", "?")
    family = FAMILIES.get(model_type)
    if family is None:
        counts = [getattr(config, key, None) for key in _MOE_KEYS]
        if any(isinstance(count, int) and count > 0 for count in counts):
            known = ", ".join(sorted(FAMILIES))
            raise ReplayError(
                f"router replay does not know the mixture-of-experts family {model_type!r} "
                f"(it knows {known})"
            )
        return None
    return RoutingShape(
        family=family,
        layers=tuple(family.moe_layers(config)),
        experts=int(getattr(config, family.experts_key)),
        top_k=int(config.num_experts_per_tok),
        normalises=family.normalises(config),
    )


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model`, in layer order (`model.layers.N.mlp.gate` of each MoE
    layer of its routing shape). Empty for a dense model; ReplayError for a family
    router replay does not know, or routers that are not where the shape says."""
    shape = routing_shape(model.config)
    if shape is None:
        return []
    modules = dict(model.named_modules())
    routers = []
    for layer in shape.layers:
        router = modules.get(f"model.layers.{layer}.mlp.gate")
        weight = getattr(router, "weight", None)
        if router is None or not isinstance(weight, torch.Tensor):
            name = f"model.layers.{layer}.mlp.gate"
            raise ReplayError(f"the model's MoE layer {layer} has no router ({name})")
        if weight.dim() != 2 or weight.shape[0] != shape.experts:
            raise ReplayError(
                f"the router of layer {layer} scores {weight.shape[0]} experts, "
                f"the config says {shape.experts}"
            )
        routers.append(router)
    return routers


class RouterReplay:
    """Replays routes in `model`'s routers while `replaying(routes)` is entered.

    Outside it (or with `routes` None) the routers choose as they always do: the
    patched forward is then the router's own, token for token. Raises ReplayError for a
    mixture of experts it cannot replay (`routing_shape`, `moe_routers`).
    """

    def __init__(self, model: nn.Module) -> None:
        self.shape = routing_shape(model.config)
        self.routers = moe_routers(model)
        self._routes: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            assert self.shape is not None
            forward = _replaying_forward(self, layer, self.shape)
            router.forward = types.MethodType(forward, router)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return self.shape.top_k if self.routers and self.shape else 0

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
        num_experts = self.shape.experts if self.shape else 0
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


def _replaying_forward(  # type: ignore[no-untyped-def]
    replay: RouterReplay, layer: int, shape: RoutingShape
):
    """The family's router forward (`hidden_states` -> logits, top-k scores, top-k ids)
    with the replayed ids in place of its own top-k."""

    def forward(router: nn.Module, hidden_states: torch.Tensor):  # type: ignore[no-untyped-def]
        hidden = hidden_states.reshape(-1, router.weight.shape[-1])
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        own_scores, own_ids = torch.topk(probs, shape.top_k, dim=-1)
        routes = replay.layer_routes(layer, hidden.shape[0])
        if routes is None:
            scores, ids = own_scores, own_ids
        else:
            ids = torch.where(routes < 0, own_ids, routes)
            scores = probs.gather(1, ids)
        if shape.normalises:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if shape.family.casts_scores:
            scores = scores.to(logits.dtype)
        return logits, scores, ids

    return forward
