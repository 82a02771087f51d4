"""Router replay: replaying the router's own choice is an ordinary forward; replaying
other experts changes the output and still trains the router."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from orchestrator_trainer.replay import ReplayError, RouterReplay, moe_routers


def own_routes(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The router's own top-k of every token and layer, `[tokens, layers, k]`."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [
        torch.topk(logits.float().softmax(-1), k, dim=-1).indices for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1)


@pytest.fixture
def model(tiny_moe: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)


IDS = torch.tensor([[5, 17, 300, 42, 9, 1000, 77, 3, 3, 512, 64, 128]])


def test_replaying_the_routers_own_choice_is_an_ordinary_forward(model) -> None:
    with torch.no_grad():
        plain = model(IDS).logits
    routes = own_routes(model, IDS)
    replay = RouterReplay(model)
    assert replay.layers == model.config.num_hidden_layers and replay.top_k == 2
    with torch.no_grad(), replay.replaying(routes):
        replayed = model(IDS).logits
    assert torch.equal(plain, replayed)
    # The order of a token's k ids does not matter either.
    with torch.no_grad(), replay.replaying(routes.flip(-1)):
        assert torch.allclose(model(IDS).logits, plain, atol=1e-6)


def test_outside_the_block_the_routers_choose_themselves(model) -> None:
    with torch.no_grad():
        before = model(IDS).logits
    replay = RouterReplay(model)
    other = (own_routes(model, IDS) + 1) % model.config.num_experts
    with torch.no_grad(), replay.replaying(other):
        pass
    with torch.no_grad(), replay.replaying(None):
        assert torch.equal(model(IDS).logits, before)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before)


def test_replayed_experts_are_the_ones_used_and_the_gates_still_train(model) -> None:
    replay = RouterReplay(model)
    routes = own_routes(model, IDS)
    other = routes.clone()
    other[:, :, 0] = (routes[:, :, 1] + 1 + torch.arange(IDS.shape[1])[:, None]) % 8
    other[:, :, 0] = torch.where(
        other[:, :, 0] == routes[:, :, 1], (other[:, :, 0] + 1) % 8, other[:, :, 0]
    )
    with torch.no_grad():
        plain = model(IDS).logits
    with replay.replaying(other):
        logits = model(IDS).logits
    assert not torch.allclose(logits, plain, atol=1e-4)
    logits.sum().backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_a_sentinel_route_falls_back_to_the_routers_choice(model) -> None:
    routes = own_routes(model, IDS)
    with torch.no_grad():
        plain = model(IDS).logits
    sentinel = routes.clone()
    sentinel[-1] = -1
    with torch.no_grad(), RouterReplay(model).replaying(sentinel):
        assert torch.equal(model(IDS).logits, plain)


def test_routes_that_do_not_fit_the_model_are_refused(model) -> None:
    replay = RouterReplay(model)
    with (
        pytest.raises(ReplayError, match="2 MoE layers of top-2"),
        replay.replaying(torch.zeros(12, 3, 2, dtype=torch.long)),
    ):
        pass
    with (
        pytest.raises(ReplayError, match="expert 8 of 8"),
        replay.replaying(torch.full((12, 2, 2), 8)),
    ):
        pass
    with (
        pytest.raises(ReplayError, match="routes for 5 tokens"),
        torch.no_grad(),
        replay.replaying(torch.zeros(5, 2, 2, dtype=torch.long)),
    ):
        model(IDS)


def test_a_dense_model_has_nothing_to_replay(tmp_path: Path) -> None:
    import tiny_moe as builder

    builder.build(tmp_path / "dense", Path(__file__).parents[2] / "demo" / "model", kind="dense")
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    replay = RouterReplay(dense)
    assert replay.layers == 0
    with (
        pytest.raises(ReplayError, match="no MoE router"),
        replay.replaying(torch.zeros(3, 2, 2, dtype=torch.long)),
    ):
        pass
