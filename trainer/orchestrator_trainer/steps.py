"""One training step: a shipped batch in, one optimizer step, the step's figures out.

Each sample is one forward over its tokens but the last (position `i` predicts token
`i + 1`), with its routed experts replayed; the loss is `loss.policy_loss` over its loss
tokens, divided by the batch's loss tokens (every token weighs the same, whatever its
sample's length), and the gradients of all samples are summed before the one step.
"""

from __future__ import annotations

import time

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


def train_step(policy: Policy, batch: Batch, train: TrainConfig) -> StepRecord:
    """One optimizer step on `batch` with the policy of `policy.version`; the policy is
    `policy.version + 1` after. Samples without a loss token are skipped; a batch without
    any leaves the weights as they were. Routes are replayed when `[train] router_replay`
    is on and the model has MoE routers. Raises ReplayError (one line) for routes that do
    not fit the model."""
    started = time.monotonic()
    replay = train.router_replay and policy.replay.layers > 0
    samples = [SampleTensors.of(s, replay=replay) for s in batch.samples]
    total_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    policy.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    masked = 0
    with_replay, without_replay = Mismatch(), Mismatch()
    for arrays, sample in zip(batch.samples, samples, strict=True):
        if not int(sample.loss_mask.sum()):
            continue
        try:
            lp = forward_logprobs(policy, sample, replay=True)
        except ReplayError as exc:
            raise ReplayError(f"step {batch.step}, rollout {arrays.rollout_id}: {exc}") from None
        terms = policy_loss(
            lp,
            sample.inference_lp,
            sample.advantages,
            sample.loss_mask,
            mask_low=train.mask_low,
            mask_high=train.mask_high,
            kl_coef=train.kl_coef,
        )
        (terms.loss / total_tokens).backward()
        loss_sum += float(terms.loss.detach())
        masked += terms.masked
        if arrays.dispatch_version != policy.version:
            continue  # off-policy: its distance to the trainer is not a mismatch
        with_replay.add(arrays.server, terms.mismatch_kl_sum, terms.tokens)
        if train.mismatch_without_replay and sample.routes is not None:
            with torch.no_grad():
                plain = forward_logprobs(policy, sample, replay=False)
            kl = mismatch_kl(plain, sample.inference_lp)[sample.loss_mask]
            without_replay.add(arrays.server, float(kl.sum()), terms.tokens)
    grad_norm = 0.0
    if total_tokens:
        limit = train.max_grad_norm or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), limit))
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
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
    )
