"""The policy-gradient loss and the training-inference mismatch (pure tensor arithmetic).

Per token, with `r = exp(lp_train - lp_infer)` (the importance ratio against the
inference logprobs) and `A` the sample's advantage: `-keep * A * r + kl_coef * (log r)^2`,
summed over loss tokens (the caller divides by the batch's loss tokens). `keep` is
prime-rl's default trust region: a token whose probability under the trainer rose more
than `mask_high` above its inference probability (positive advantage), or fell more than
`mask_low` below it (otherwise), leaves the policy gradient; the squared log ratio still
pulls it back. The gradient of `A * r` is `A * r * grad(lp_train)`: on-policy (`r = 1`)
it is REINFORCE with the group's advantage, token by token.

The mismatch is the k3 estimator of KL(inference || trainer), `r - log r - 1`, averaged
over loss tokens (prime-rl's `mismatch_kl`): 0 when both sides give the same logprobs,
always >= 0.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class LossTerms:
    """One sample's loss (a sum over its loss tokens) and what it is made of."""

    loss: torch.Tensor
    tokens: int
    masked: int
    mismatch_kl_sum: float


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The logprob of each `targets[i]` under `logits[i]` (`[n, vocab]`, `[n]`), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def mismatch_kl(trainer_lp: torch.Tensor, inference_lp: torch.Tensor) -> torch.Tensor:
    """Per token, `r - log r - 1` with `log r = trainer_lp - inference_lp`, in float64 as
    `expm1(log r) - log r`: near 0 it is `(log r)^2 / 2`, which float32's `exp` would round
    to 0 below a log ratio of about 5e-4, hiding exactly the mismatch worth seeing."""
    log_ratio = trainer_lp.detach().double() - inference_lp.double()
    return torch.expm1(log_ratio) - log_ratio


def policy_loss(
    trainer_lp: torch.Tensor,
    inference_lp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mask_low: float,
    mask_high: float,
    kl_coef: float,
) -> LossTerms:
    """The loss of one sample's tokens (all `[n]`; `loss_mask` bool)."""
    log_ratio = trainer_lp - inference_lp
    ratio = torch.exp(log_ratio)
    moved = torch.exp(trainer_lp) - torch.exp(inference_lp)
    positive = advantages > 0
    outside = torch.where(positive, moved > mask_high, moved < -mask_low)
    keep = loss_mask & ~outside
    per_token = -(keep * advantages * ratio) + kl_coef * loss_mask * log_ratio**2
    kl = mismatch_kl(trainer_lp, inference_lp)
    return LossTerms(
        loss=per_token.sum(),
        tokens=int(loss_mask.sum()),
        masked=int((loss_mask & outside).sum()),
        mismatch_kl_sum=float(kl[loss_mask].sum()),
    )
