"""The policy-gradient loss and the mismatch KL."""

from __future__ import annotations

import math

import torch
from orchestrator_trainer.loss import mismatch_kl, policy_loss, token_logprobs

SETTINGS = {"mask_low": 0.2, "mask_high": 0.2, "kl_coef": 0.0}


def test_on_policy_the_gradient_is_reinforce_with_the_advantage() -> None:
    logits = torch.randn(5, 11, requires_grad=True)
    targets = torch.tensor([1, 4, 7, 2, 10])
    lp = token_logprobs(logits, targets)
    advantages = torch.tensor([0.0, 0.5, 0.5, -1.0, -1.0])
    mask = torch.tensor([False, True, True, True, True])
    terms = policy_loss(lp, lp.detach(), advantages, mask, **SETTINGS)
    (grad,) = torch.autograd.grad(terms.loss, logits)
    expected_logits = logits.detach().clone().requires_grad_(True)
    reinforce = -(advantages * mask * token_logprobs(expected_logits, targets)).sum()
    (expected,) = torch.autograd.grad(reinforce, expected_logits)
    assert torch.allclose(grad, expected, atol=1e-6)
    assert terms.tokens == 4 and terms.masked == 0 and terms.mismatch_kl_sum == 0.0


def test_tokens_outside_the_trust_region_leave_the_policy_gradient() -> None:
    inference = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    # Probabilities moved by +0.3, +0.1, -0.3, -0.1 since inference.
    trainer = torch.log(torch.tensor([0.8, 0.6, 0.2, 0.4])).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    terms = policy_loss(trainer, inference, advantages, mask, **SETTINGS)
    assert terms.masked == 2
    (grad,) = torch.autograd.grad(terms.loss, trainer)
    assert grad[0] == 0 and grad[2] == 0 and grad[1] != 0 and grad[3] != 0
    # A token that moved against its advantage is never masked: the gradient brings it back.
    back = policy_loss(trainer, inference, -advantages, mask, **SETTINGS)
    assert back.masked == 0


def test_the_kl_term_pulls_masked_tokens_back() -> None:
    inference = torch.log(torch.tensor([0.5]))
    trainer = torch.log(torch.tensor([0.9])).requires_grad_(True)
    terms = policy_loss(
        trainer,
        inference,
        torch.tensor([1.0]),
        torch.tensor([True]),
        mask_low=0.2,
        mask_high=0.2,
        kl_coef=0.1,
    )
    (grad,) = torch.autograd.grad(terms.loss, trainer)
    assert terms.masked == 1 and grad[0] > 0  # descending it lowers the logprob


def test_the_mismatch_kl_is_zero_when_equal_and_sees_tiny_differences() -> None:
    lp = torch.log(torch.tensor([0.1, 0.2, 0.7]))
    assert torch.equal(mismatch_kl(lp, lp), torch.zeros(3, dtype=torch.float64))
    for delta in (1e-5, 1e-4, 1e-2, -1e-3):
        kl = mismatch_kl(lp + delta, lp)
        expected = math.expm1(delta) - delta
        assert torch.allclose(kl, torch.full((3,), expected, dtype=torch.float64), rtol=1e-2)
        assert (kl > 0).all()
    assert float(mismatch_kl(torch.tensor([-1.0]), torch.tensor([-3.0]))[0]) > 1
