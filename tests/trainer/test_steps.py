"""A training step's speed settings change its cost, not what it learns: samples packed
into micro-batches give the per-sample forward's logprobs and gradient; `trained_layers`
leaves everything below the top layers as it was; bfloat16 autocast trains; each step
says where its seconds went."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tiny_moe as builder
import torch
from orchestrator_trainer.policy import PolicyError, decoder_layers, load_policy
from orchestrator_trainer.steps import (
    SampleTensors,
    forward_logprobs,
    micro_batches,
    packed_logprobs,
    train_step,
)

from orchestrator import Batch, SampleArrays
from orchestrator.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-dense") / "model"
    builder.build(folder, ROOT / "demo" / "model", kind="dense")
    return folder


def batch(lengths: list[int], *, prompt: int = 4, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    samples = []
    for index, length in enumerate(lengths):
        mask = np.zeros(length, dtype=np.bool_)
        mask[prompt:] = True
        advantage = float(rng.normal())
        samples.append(
            SampleArrays(
                group_id="g",
                rollout_id=f"r{index}",
                start_version=0,
                dispatch_version=0,
                reward=0.0,
                advantage=advantage,
                length=length,
                rows=range(length),
                token_ids=rng.integers(0, 1000, length).astype(np.int32),
                loss_mask=mask,
                advantages=np.where(mask, advantage, 0).astype(np.float32),
                logprobs=np.where(mask, -7.0, 0).astype(np.float32),
                routed_experts=None,
                sampling_mask=None,
            )
        )
    return Batch(step=1, created_at=time.time(), samples=samples)


def test_samples_are_packed_by_length_up_to_the_budget() -> None:
    assert micro_batches([5, 3, 9, 4], 0) == [[0], [1], [2], [3]]
    # Sorted by length; a pack padded to its longest stays within the budget.
    assert micro_batches([5, 3, 9, 4], 12) == [[1, 3], [0], [2]]
    assert micro_batches([5, 3, 9, 4], 100) == [[1, 3, 0, 2]]
    # A sample over the budget goes alone.
    assert micro_batches([50, 3], 10) == [[1], [0]]


def test_a_packed_forward_gives_each_samples_own_logprobs(tiny_dense: Path) -> None:
    policy = load_policy(tiny_dense, 0, TrainConfig(), seed=0)
    policy.model.eval()
    samples = [SampleTensors.of(s, replay=False) for s in batch([7, 12, 9]).samples]
    with torch.no_grad():
        packed = packed_logprobs(policy, samples)
        alone = [forward_logprobs(policy, sample, replay=False) for sample in samples]
    for got, want in zip(packed, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_micro_batches_take_the_same_step_as_one_sample_per_forward(tiny_dense: Path) -> None:
    lengths = [7, 12, 9, 15, 6]
    stepped = []
    for tokens in (0, 64):
        train = TrainConfig(learning_rate=1e-3, micro_batch_tokens=tokens)
        policy = load_policy(tiny_dense, 0, train, seed=0)
        record = train_step(policy, batch(lengths), train)
        stepped.append((record, [p.detach().clone() for p in policy.model.parameters()]))
    (alone, alone_weights), (packed, packed_weights) = stepped
    assert packed.loss == pytest.approx(alone.loss, abs=1e-5)
    assert packed.grad_norm == pytest.approx(alone.grad_norm, rel=1e-4)
    # Adam's step is about the learning rate whatever the gradient's size: the same
    # gradient's summation order moves weights by far less than it.
    for got, want in zip(packed_weights, alone_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_only_the_top_layers_train(tiny_dense: Path) -> None:
    train = TrainConfig(learning_rate=1e-2, trained_layers=1)
    policy = load_policy(tiny_dense, 0, train, seed=0)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    train_step(policy, batch([8, 10]), train)
    layers = len(decoder_layers(policy.model))
    top = f"layers.{layers - 1}."
    moved = {
        name
        for name, p in policy.model.named_parameters()
        if not torch.equal(p.detach(), before[name])
    }
    assert moved, "nothing trained"
    # The top layer, the final norm and the tiny model's untied head: nothing below.
    after = (top, "model.norm.", "lm_head.")
    assert all(any(part in name for part in after) for name in moved), moved
    assert any(top in name for name in moved)
    assert not any("embed" in name for name in moved)


def test_more_trained_layers_than_the_model_has_is_one_line(tiny_dense: Path) -> None:
    with pytest.raises(PolicyError, match="trained_layers = 99, but the model has"):
        load_policy(tiny_dense, 0, TrainConfig(trained_layers=99), seed=0)


def test_a_bfloat16_step_trains_and_says_where_its_seconds_went(tiny_dense: Path) -> None:
    train = TrainConfig(learning_rate=1e-3, autocast="bfloat16", micro_batch_tokens=64)
    policy = load_policy(tiny_dense, 0, train, seed=0)
    before = [p.detach().clone() for p in policy.model.parameters()]
    record = train_step(policy, batch([8, 10, 6]), train)
    assert np.isfinite(record.loss) and record.grad_norm > 0
    after = list(policy.model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(after, before, strict=True))
    # The weights stay in the checkpoint's dtype: autocast is the forward's only.
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert record.forward_s > 0 and record.backward_s > 0 and record.optimizer_s > 0
    assert record.forward_s + record.backward_s + record.optimizer_s <= record.seconds
