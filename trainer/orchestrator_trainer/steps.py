"""One training step: a shipped batch in, one optimizer step, the step's figures out.

Each sample is a forward over its tokens but the last (position `i` predicts token
`i + 1`), with its routed experts replayed; the loss is `loss.policy_loss` over its loss
tokens, divided by the batch's loss tokens (every token weighs the same, whatever its
sample's length), and the gradients of all samples are summed before the one step.
Without replay, samples sorted by length share forwards (`[train] micro_batch_tokens`,
right-padded, the padding masked): on the CPU, one forward of 16 short samples costs
far less than 16 forwards of one. The step's seconds are split into forward, backward
and optimizer in its record.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from orchestrator import Batch, SampleArrays
from orchestrator.config import TrainConfig
from orchestrator_trainer.loss import mismatch_kl, policy_loss, token_logprobs
from orchestrator_trainer.policy import Policy
from orchestrator_trainer.replay import ReplayError
from orchestrator_trainer.step_log import Mismatch, StepRecord


@attrs.frozen
class SampleTensors:
    """A sample as the forward takes it: inputs, their targets, and per target its loss
    mask, advantage and inference logprob; the inputs' routes (None: no replay)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_lp: torch.Tensor
    routes: torch.Tensor | None

    @classmethod
    def of(cls, sample: SampleArrays, *, replay: bool) -> SampleTensors:
        ids = torch.from_numpy(np.asarray(sample.token_ids, dtype=np.int64))
        routes = None
        if replay and sample.routed_experts is not None:
            routes = torch.from_numpy(np.asarray(sample.routed_experts[:-1], dtype=np.int64))
        return cls(
            inputs=ids[:-1],
            targets=ids[1:],
            loss_mask=torch.from_numpy(np.asarray(sample.loss_mask[1:], dtype=np.bool_)),
            advantages=torch.from_numpy(np.asarray(sample.advantages[1:], dtype=np.float32)),
            inference_lp=torch.from_numpy(np.asarray(sample.logprobs[1:], dtype=np.float32)),
            routes=routes,
        )


def forward_logprobs(policy: Policy, sample: SampleTensors, *, replay: bool) -> torch.Tensor:
    """The trainer's logprob of each target (with the sample's routes when `replay`)."""
    with policy.replay.replaying(sample.routes if replay else None):
        logits = policy.model(input_ids=sample.inputs.unsqueeze(0)).logits[0]
    return token_logprobs(logits, sample.targets)


def packed_logprobs(policy: Policy, samples: Sequence[SampleTensors]) -> list[torch.Tensor]:
    """The trainer's logprobs of several samples' targets from one forward: the inputs
    right-padded to the longest, the padding masked out of attention (no replay)."""
    longest = max(len(s.inputs) for s in samples)
    inputs = torch.zeros((len(samples), longest), dtype=torch.int64)
    mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        inputs[row, : len(sample.inputs)] = sample.inputs
        mask[row, : len(sample.inputs)] = 1
    logits = policy.model(input_ids=inputs, attention_mask=mask).logits
    return [
        token_logprobs(logits[row, : len(sample.inputs)], sample.targets)
        for row, sample in enumerate(samples)
    ]


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """The indices of samples of `lengths` packed into micro-batches: sorted by length
    (so padding is least), each at most `max_tokens` once padded to its longest (a
    sample longer than that alone). `max_tokens` 0: one sample each, in order."""
    if max_tokens <= 0:
        return [[index] for index in range(len(lengths))]
    batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if current and lengths[index] * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def train_step(policy: Policy, batch: Batch, train: TrainConfig) -> StepRecord:
    """One optimizer step on `batch` with the policy of `policy.version`; the policy is
    `policy.version + 1` after. Samples without a loss token are skipped; a batch without
    any leaves the weights as they were. Routes are replayed when `[train] router_replay`
    is on and the model has MoE routers (one sample per forward then); otherwise samples
    are packed into micro-batches of `[train] micro_batch_tokens`. Raises ReplayError
    (one line) for routes that do not fit the model."""
    started = time.monotonic()
    replay = train.router_replay and policy.replay.layers > 0
    samples = [SampleTensors.of(s, replay=replay) for s in batch.samples]
    total_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    policy.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    masked = 0
    forward_s = backward_s = 0.0
    with_replay, without_replay = Mismatch(), Mismatch()
    trained = [i for i, s in enumerate(samples) if int(s.loss_mask.sum())]
    per_batch = 0 if replay else train.micro_batch_tokens
    packs = micro_batches([len(samples[i].inputs) for i in trained], per_batch)
    for pack in packs:
        indices = [trained[i] for i in pack]
        clock = time.monotonic()
        with _autocast(train):
            if len(indices) == 1:
                arrays = batch.samples[indices[0]]
                try:
                    lps = [forward_logprobs(policy, samples[indices[0]], replay=True)]
                except ReplayError as exc:
                    where = f"step {batch.step}, rollout {arrays.rollout_id}"
                    raise ReplayError(f"{where}: {exc}") from None
            else:
                lps = packed_logprobs(policy, [samples[i] for i in indices])
        pack_loss: torch.Tensor | None = None
        for index, lp in zip(indices, lps, strict=True):
            arrays, sample = batch.samples[index], samples[index]
            terms = policy_loss(
                lp,
                sample.inference_lp,
                sample.advantages,
                sample.loss_mask,
                mask_low=train.mask_low,
                mask_high=train.mask_high,
                kl_coef=train.kl_coef,
            )
            pack_loss = terms.loss if pack_loss is None else pack_loss + terms.loss
            loss_sum += float(terms.loss.detach())
            masked += terms.masked
            if arrays.dispatch_version != policy.version:
                continue  # off-policy: its distance to the trainer is not a mismatch
            with_replay.add(arrays.server, terms.mismatch_kl_sum, terms.tokens)
            if train.mismatch_without_replay and sample.routes is not None:
                with torch.no_grad(), _autocast(train):
                    plain = forward_logprobs(policy, sample, replay=False)
                kl = mismatch_kl(plain, sample.inference_lp)[sample.loss_mask]
                without_replay.add(arrays.server, float(kl.sum()), terms.tokens)
        forward_s += time.monotonic() - clock
        clock = time.monotonic()
        assert pack_loss is not None
        (pack_loss / total_tokens).backward()
        backward_s += time.monotonic() - clock
    clock = time.monotonic()
    grad_norm = 0.0
    if total_tokens:
        limit = train.max_grad_norm or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), limit))
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    optimizer_s = time.monotonic() - clock
    rewards = [s.reward for s in batch.samples]
    return StepRecord(
        step=batch.step,
        version=policy.version,
        samples=len(batch.samples),
        tokens=total_tokens,
        loss=loss_sum / total_tokens if total_tokens else 0.0,
        grad_norm=grad_norm,
        clipped_share=masked / total_tokens if total_tokens else 0.0,
        reward_mean=float(np.mean(rewards)) if rewards else 0.0,
        seconds=time.monotonic() - started,
        on_policy_samples=with_replay.samples,
        mismatch_kl=with_replay.mean,
        mismatch_kl_no_replay=without_replay.mean,
        mismatch_by_server=with_replay.server_means(),
        dropped=len(batch.dropped),
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
    )


def _autocast(train: TrainConfig) -> contextlib.AbstractContextManager[object]:
    """The forward's autocast (`[train] autocast`), on the CPU."""
    if train.autocast == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
