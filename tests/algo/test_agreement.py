"""Rollout vs trainer log-probs: ``token_mult_prob_error`` and truncated importance weights (``algo/agreement.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import ppo_policy_loss
from mcore_rl.algo.agreement import prob_agreement, truncated_importance_weights


def test_token_mult_prob_error_is_nemo_rl_s_token_mean_of_exp_abs_difference() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    rollout = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.0, -2.5, 0.0], [-0.3, 0.0, 0.0]])
    agreement = prob_agreement(rollout, trainer, mask)
    expected = (1 + math.exp(0.5) + math.exp(0.2)) / 3  # the masked 9.0 is ignored
    assert agreement.token_mult_prob_error == pytest.approx(expected)
    assert agreement.worst(1)[0][0] == 0 and agreement.per_sequence[1].item() == pytest.approx(math.exp(0.2))
    assert prob_agreement(rollout, rollout, mask).token_mult_prob_error == 1.0


def test_truncated_importance_weights_are_the_clamped_probability_ratio_on_response_tokens() -> None:
    old = torch.tensor([[0.0, -0.1, -2.0, -0.5], [-1.0, -1.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[0.0, -0.3, -0.1, -3.0], [-1.5, -0.2, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    tis = truncated_importance_weights(old, rollout, mask, threshold=2.0)
    raw = [math.exp(0.2), math.exp(-1.9), math.exp(2.5), math.exp(0.5), math.exp(-0.8)]
    expected = torch.tensor([[0.0, raw[0], raw[1], 2.0], [raw[3], raw[4], 0.0, 0.0]])
    torch.testing.assert_close(tis.weights, expected)
    assert not tis.weights.requires_grad  # constants of the loss, as TIS treats them
    assert tis.metrics["rollout_is/truncated_frac"] == pytest.approx(1 / 5)
    assert tis.metrics["rollout_is/max_raw"] == pytest.approx(raw[2], rel=1e-6)
    assert tis.metrics["rollout_is/mean"] == pytest.approx(float(expected.sum()) / 5, rel=1e-6)


@pytest.mark.parametrize("clip_ratio_c", [3.0, 1.5])
def test_weighting_the_advantages_is_the_weighted_ppo_loss_value_and_gradient(clip_ratio_c: float) -> None:
    """Why the driver may fold TIS into the advantages: l(w * A) == w * l(A) for w >= 0, dual clip included."""
    gen = torch.Generator().manual_seed(0)
    shape = (6, 9)
    old = -torch.rand(shape, generator=gen) * 2
    advantages = torch.randn(shape, generator=gen) * 2
    mask = (torch.rand(shape, generator=gen) > 0.2).float()
    weights = torch.rand(shape, generator=gen) * 2
    weights[0, :3] = 0.0
    results = []
    for folded in (True, False):
        log_probs = (
            old + torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.5
        ).requires_grad_()
        out = ppo_policy_loss(
            log_probs,
            old,
            advantages * weights if folded else advantages,
            mask,
            clip_ratio_c=clip_ratio_c,
            importance_weights=None if folded else weights,
        )
        out.loss.backward()
        results.append((out.loss.detach(), log_probs.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)
