"""Router replay, for each family it knows (a tiny Qwen3-MoE and a tiny Mixtral):
replaying the router's own choice is an ordinary forward; replaying other experts changes
the output and still trains the router; a family it does not know is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from orchestrator_trainer.replay import ReplayError, RouterReplay, moe_routers, routing_shape


def own_routes(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The router's own top-k of every token and layer, `[tokens, layers, k]`."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [
        torch.topk(logits.float().softmax(-1), k, dim=-1).indices for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1)


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    folder = request.getfixturevalue("tiny_moe" if request.param == "qwen3_moe" else "tiny_mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.model_type == request.param
    return model


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
    other = (own_routes(model, IDS) + 1) % 8
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


def test_replaying_the_own_choice_in_bfloat16_is_an_ordinary_forward(model) -> None:
    # Each family's scores keep their dtype (Qwen3-MoE casts them to the logits'; Mixtral
    # keeps float32): the replayed forward rounds as the router's own.
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        plain = model(IDS).logits
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replaying(own_routes(model, IDS)):
        assert torch.equal(model(IDS).logits, plain)


def test_the_routing_shape_is_the_configs() -> None:
    qwen = transformers.Qwen3MoeConfig(
        num_hidden_layers=6, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[1]
    )
    shape = routing_shape(qwen)
    assert shape is not None
    assert (shape.layers, shape.experts, shape.top_k) == ((0, 2, 3, 4, 5), 16, 4)
    sparse = routing_shape(transformers.Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2))
    assert sparse is not None and sparse.layers == (1, 3, 5)
    mixtral = routing_shape(
        transformers.MixtralConfig(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)
    )
    assert mixtral is not None
    assert (mixtral.layers, mixtral.experts, mixtral.top_k) == ((0, 1, 2), 4, 2)
    assert routing_shape(transformers.LlamaConfig()) is None


def test_a_family_it_does_not_know_is_refused_in_one_line() -> None:
    config = transformers.Qwen2MoeConfig(num_hidden_layers=2)
    with pytest.raises(ReplayError) as refused:
        routing_shape(config)
    assert str(refused.value) == (
        "router replay does not know the mixture-of-experts family 'qwen2_moe' "
        "(it knows mixtral, qwen3_moe)"
    )
    tiny = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
    )
    with pytest.raises(ReplayError, match="'qwen2_moe'"):
        RouterReplay(transformers.AutoModelForCausalLM.from_config(tiny))


def test_routers_that_are_not_where_the_config_says_are_refused(model) -> None:
    model.config.num_hidden_layers = 3  # the config says three MoE layers, the model has two
    with pytest.raises(ReplayError, match=r"MoE layer 2 has no router \(model.layers.2.mlp.gate\)"):
        RouterReplay(model)
