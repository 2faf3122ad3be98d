"""A multi-turn row's tool and environment tokens are context only: every term of the loss (policy, KL,
entropy), the agreement metric and GAE read the model's tokens alone, so a row with tool tokens between its
turns gives exactly what the row of its model tokens alone gives, whatever sits at the tool positions."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo import LossAggregation, kl_loss, ppo_policy_loss
from mcore_rl.algo.advantages import compute_gae_advantages
from mcore_rl.algo.agreement import prob_agreement

GEN = torch.Generator().manual_seed(0)
# rows of 10 positions: model turns with context (tool) tokens between them, and right padding
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 1, 1, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
    ],
    dtype=torch.float32,
)


def _compact(x: torch.Tensor) -> torch.Tensor:
    """Each row's model positions alone, right-padded with 0 (what a one-turn row of those tokens holds)."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        kept = x[row][MASK[row] > 0]
        out[row, : kept.numel()] = kept
    return out


def _compact_mask() -> torch.Tensor:
    counts = MASK.sum(1).long()
    return (torch.arange(MASK.shape[1])[None, :] < counts[:, None]).float()


def _with_garbage(x: torch.Tensor) -> torch.Tensor:
    """``x`` with huge values at the context and padding positions (what a tool token's log-prob may hold)."""
    return torch.where(MASK > 0, x, torch.full_like(x, 1e4))


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_losses_and_agreement_read_the_model_tokens_only(agg_mode: str) -> None:
    log_probs = -torch.rand(MASK.shape, generator=GEN) * 3
    old = log_probs + 0.3 * torch.randn(MASK.shape, generator=GEN)
    ref = log_probs + 0.2 * torch.randn(MASK.shape, generator=GEN)
    adv = torch.randn(MASK.shape[0], 1, generator=GEN).expand_as(MASK) * MASK
    tokens = MASK.sum()
    agg = LossAggregation(agg_mode, global_num_tokens=tokens, global_num_seqs=torch.tensor(3.0))
    holes = ppo_policy_loss(_with_garbage(log_probs), _with_garbage(old), adv, MASK, agg=agg)
    compact_mask = _compact_mask()
    compact = ppo_policy_loss(_compact(log_probs), _compact(old), _compact(adv), compact_mask, agg=agg)
    for field in ("loss", "clip_frac", "approx_kl"):
        assert torch.allclose(getattr(holes, field), getattr(compact, field), atol=1e-6), field
    kl_holes = kl_loss(_with_garbage(log_probs), _with_garbage(ref), MASK, agg=agg)
    assert torch.allclose(
        kl_holes, kl_loss(_compact(log_probs), _compact(ref), compact_mask, agg=agg), atol=1e-6
    )
    entropy = torch.rand(MASK.shape, generator=GEN)
    assert torch.allclose(
        agg.aggregate(_with_garbage(entropy), MASK), agg.aggregate(_compact(entropy), compact_mask)
    )
    trainer = torch.where(MASK > 0, old - 0.01, torch.full_like(old, -1e4))  # the tool tokens far apart
    agreement = prob_agreement(_with_garbage(old), trainer, MASK)
    assert agreement.token_mult_prob_error == pytest.approx(torch.tensor(0.01).exp().item())


def test_gae_runs_over_the_model_tokens_only() -> None:
    """Values are read at model tokens, and the TD chain steps from one model token to the next across the
    tool tokens: GAE of the row equals GAE of its model tokens alone, scattered back (0 on the context)."""
    rewards = torch.zeros(MASK.shape)
    last = (MASK * torch.arange(10)).argmax(1)
    rewards[torch.arange(3), last] = torch.tensor([1.0, -0.5, 2.0])
    values = torch.randn(MASK.shape, generator=GEN)
    holes = compute_gae_advantages(rewards, _with_garbage(values), MASK, gamma=0.9, lam=0.8)
    compact = compute_gae_advantages(_compact(rewards), _compact(values), _compact_mask(), gamma=0.9, lam=0.8)
    for field in ("advantages", "returns"):
        got, want = getattr(holes, field), getattr(compact, field)
        assert torch.allclose(_compact(got), want, atol=1e-6), field
        assert (got[MASK == 0] == 0).all(), field
