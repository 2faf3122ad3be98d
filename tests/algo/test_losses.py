"""Loss aggregation, PPO / GSPO policy losses and the value loss: hand-computed cases and properties."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import (
    LossAggMode,
    LossAggregation,
    aggregate_loss,
    gspo_policy_loss,
    num_valid_seqs,
    ppo_policy_loss,
    value_loss,
)

NAN = float("nan")
MODES = [mode.value for mode in LossAggMode]


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- aggregation

# Row 0: 3 tokens summing to 6 (mean 2); row 1: one token, 4; row 2: fully masked (padding row, NaN inside).
AGG_LOSS = t([[1, 2, 3], [4, NAN, NAN], [NAN, NAN, NAN]])
AGG_MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("token-sum", 1 + 2 + 3 + 4),
        ("seq-mean-token-sum", (6 + 4) / 2),  # the fully masked row is not a sequence
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / 2 / 3),  # norm constant defaults to T = 3
    ],
)
def test_aggregate_hand_cases(mode: str, expected: float) -> None:
    torch.testing.assert_close(aggregate_loss(AGG_LOSS, AGG_MASK, mode), scalar(expected))


def test_aggregate_with_global_counts_and_norm_constant() -> None:
    loss = aggregate_loss(AGG_LOSS, AGG_MASK, "token-mean", global_num_tokens=8)
    torch.testing.assert_close(loss, scalar(10 / 8))
    loss = aggregate_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum", global_num_seqs=4)
    torch.testing.assert_close(loss, scalar(10 / 4))
    loss = aggregate_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", global_num_seqs=4, norm_constant=5)
    torch.testing.assert_close(loss, scalar(10 / 4 / 5))
    torch.testing.assert_close(num_valid_seqs(AGG_MASK), torch.tensor(2))


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_empty_mask_gives_zero_and_finite_grad(mode: str) -> None:
    loss_mat = torch.full((2, 3), NAN, requires_grad=True)
    loss = aggregate_loss(loss_mat, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert loss_mat.grad is not None and (loss_mat.grad == 0).all()


def random_batch(seed: int, batch: int = 10, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss matrix with NaN in padding and ragged, right-padded masks including fully masked rows."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0], lengths[3] = 0, length
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).float()
    loss_mat = torch.where(mask.bool(), torch.randn(batch, length, generator=gen), torch.full((), NAN))
    return loss_mat, mask


# DP ranks own rows [0, 4), [4, 5), [5, 10); each rank splits its rows into uneven micro-batches.
SPLITS = [[(0, 1), (1, 4)], [(4, 5)], [(5, 7), (7, 8), (8, 10)]]


def shards(loss_mat: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches over all DP ranks, each trimmed to its own longest response (as dynamic padding does)."""
    out = []
    for rank in SPLITS:
        for lo, hi in rank:
            width = max(int(mask[lo:hi].sum(dim=-1).max()), 1)
            out.append((loss_mat[lo:hi, :width], mask[lo:hi, :width]))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_invariant_to_dp_and_micro_batch_split(mode: str) -> None:
    loss_mat, mask = random_batch(seed=4)
    full_leaf = loss_mat.clone().requires_grad_()
    agg = {
        "global_num_tokens": mask.sum(),
        "global_num_seqs": num_valid_seqs(mask),
        "norm_constant": mask.shape[-1],
    }
    full = aggregate_loss(full_leaf, mask, mode, **agg)
    full.backward()

    split_leaf = loss_mat.clone().requires_grad_()
    pieces = [aggregate_loss(lm, m, mode, **agg) for lm, m in shards(split_leaf, mask)]
    total = torch.stack(pieces).sum()
    total.backward()

    assert torch.isfinite(full)
    torch.testing.assert_close(total, full)
    assert full_leaf.grad is not None and split_leaf.grad is not None
    torch.testing.assert_close(split_leaf.grad, full_leaf.grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_local_counts_are_not_split_invariant(mode: str) -> None:
    # Without global counts each micro-batch is normalised on its own, so the split changes the result;
    # this is what the global counts are for (and shows the invariance test above can fail).
    loss_mat, mask = random_batch(seed=4)
    pieces = [aggregate_loss(lm, m, mode) for lm, m in shards(loss_mat, mask)]
    num_shards = len(pieces)
    average = torch.stack(pieces).sum() / num_shards
    assert not torch.allclose(average, aggregate_loss(loss_mat, mask, mode), atol=1e-3)


def test_aggregate_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'token_mean'.*'token-mean'"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "token_mean")
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), global_num_tokens=0)
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(torch.zeros(6), torch.ones(6))


# ---------------------------------------------------------------------------------------------- PPO

# old log-prob -1 everywhere; ratios r = (1.5, 0.5, 1.1, 5.0), advantages (1, -1, 2, -1); clip 0.2 / 0.28, c = 3.
#   t0: max(-1.5, -1.28) = -1.28            (clipped above)
#   t1: max(0.5, 0.8) = 0.8, min(3, .8)      (clipped below)
#   t2: max(-2.2, -2.2) = -2.2               (inside the trust region)
#   t3: max(5, 1.28) = 5, min(3, 5) = 3      (dual clip)
PPO_OLD = t([[-1.0, -1.0, -1.0, -1.0]])
PPO_NEW = PPO_OLD + torch.log(t([[1.5, 0.5, 1.1, 5.0]]))
PPO_ADV = t([[1.0, -1.0, 2.0, -1.0]])
PPO_MASK = t([[1, 1, 1, 1]])


def test_ppo_hand_case_with_gradient() -> None:
    log_probs = PPO_NEW.clone().requires_grad_()
    out = ppo_policy_loss(log_probs, PPO_OLD, PPO_ADV, PPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(out.loss, scalar((-1.28 + 0.8 - 2.2 + 3.0) / 4))
    torch.testing.assert_close(out.clip_frac, scalar(0.5))
    torch.testing.assert_close(out.clip_frac_lower, scalar(0.25))
    torch.testing.assert_close(out.approx_kl, scalar(-math.log(1.5 * 0.5 * 1.1 * 5.0) / 4))
    out.loss.backward()
    # Only the unclipped token carries a gradient: d(-A r)/d logp = -A r = -2.2, over 4 tokens.
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, t([[0.0, 0.0, -0.55, 0.0]]))
    assert not out.clip_frac.requires_grad


def test_ppo_importance_weights_multiply_token_losses() -> None:
    weights = t([[1.0, 2.0, 0.5, 1.0]])
    out = ppo_policy_loss(
        PPO_NEW,
        PPO_OLD,
        PPO_ADV,
        PPO_MASK,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        importance_weights=weights,
    )
    torch.testing.assert_close(out.loss, scalar((-1.28 + 1.6 - 1.1 + 3.0) / 4))


def test_ppo_symmetric_clip_and_other_modes() -> None:
    # clip_ratio 0.2 for both sides: t0 becomes -1.2. seq-mean-token-sum of the single row = the token sum.
    out = ppo_policy_loss(PPO_NEW, PPO_OLD, PPO_ADV, PPO_MASK, agg=LossAggregation("seq-mean-token-sum"))
    torch.testing.assert_close(out.loss, scalar(-1.2 + 0.8 - 2.2 + 3.0))


def test_ppo_ratio_one_means_no_clipping() -> None:
    gen = torch.Generator().manual_seed(5)
    old = torch.randn(6, 5, generator=gen) - 2
    adv = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    log_probs = old.clone().requires_grad_()
    out = ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert out.clip_frac.item() == 0 and out.clip_frac_lower.item() == 0 and out.approx_kl.item() == 0
    num_tokens = mask.sum()
    torch.testing.assert_close(out.loss, -(adv * mask).sum() / num_tokens)
    out.loss.backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, -adv * mask / num_tokens)


def test_ppo_log_ratio_is_clamped() -> None:
    # log-ratio 50 would overflow exp() in float32; it is clamped to 20 (and the dual clip caps A < 0).
    out = ppo_policy_loss(t([[49.0, 49.0]]), t([[-1.0, -1.0]]), t([[1.0, -1.0]]), t([[1, 1]]))
    torch.testing.assert_close(out.loss, scalar((-1.2 + 3.0) / 2))
    torch.testing.assert_close(out.approx_kl, scalar(-20.0))


def test_ppo_nan_in_masked_positions_does_not_leak() -> None:
    gen = torch.Generator().manual_seed(6)
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    old, new, adv, weights = (torch.randn(3, 4, generator=gen) for _ in range(4))

    def dirty(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask.bool(), x, torch.full((), NAN))

    results, grads = [], []
    for prep in (lambda x: x, dirty):
        log_probs = prep(new).detach().requires_grad_()
        out = ppo_policy_loss(log_probs, prep(old), prep(adv), mask, importance_weights=prep(weights))
        out.loss.backward()
        results.append(out)
        grads.append(log_probs.grad)
    clean, nan = results
    for field in ("loss", "clip_frac", "clip_frac_lower", "approx_kl"):
        torch.testing.assert_close(getattr(nan, field), getattr(clean, field))
    assert grads[1] is not None and torch.isfinite(grads[1]).all()
    assert (grads[1][mask == 0] == 0).all()


def test_ppo_bf16_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    old, new, adv = (torch.randn(4, 6, generator=gen).to(torch.bfloat16) for _ in range(3))
    mask = torch.ones(4, 6, dtype=torch.bool)
    log_probs = new.clone().requires_grad_()
    out = ppo_policy_loss(log_probs, old, adv, mask)
    ref = ppo_policy_loss(new.float(), old.float(), adv.float(), mask)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    assert log_probs.grad is not None and log_probs.grad.dtype == torch.bfloat16


def test_ppo_errors() -> None:
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(ones, ones, ones, ones, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(ones, ones, torch.ones(2, 4), ones)
    with pytest.raises(ValueError, match="importance_weights"):
        ppo_policy_loss(ones, ones, ones, ones, importance_weights=torch.ones(3, 3))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ppo_policy_loss(ones, ones, ones, ones, agg=LossAggregation("mean"))


# ---------------------------------------------------------------------------------------------- GSPO


def test_gspo_hand_case_with_gradient() -> None:
    # Row 0: token log-ratios 0.1, 0.2, 0.3 -> sequence ratio e^0.2 = 1.2214 > 1 + 4e-4, A = 1: every token
    # is clipped to -(1 + 4e-4). Row 1: log-ratios -0.1, 0.1 (NaN padding) -> ratio 1, A = -2: loss 2.
    # seq-mean-token-mean: (-1.0004 + 2) / 2. Gradient only from row 1: -A * 1 / 2 tokens / 2 sequences.
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, NAN]])
    log_probs = (old + t([[0.1, 0.2, 0.3], [-0.1, 0.1, NAN]])).requires_grad_()
    mask = t([[1, 1, 1], [1, 1, 0]])
    out = gspo_policy_loss(log_probs, old, t([[1, 1, 1], [-2, -2, NAN]]), mask)
    torch.testing.assert_close(out.loss, scalar((-(1 + 4e-4) + 2.0) / 2))
    torch.testing.assert_close(out.clip_frac, scalar(3 / 5))
    torch.testing.assert_close(out.approx_kl, scalar(-0.6 / 5))
    assert out.clip_frac_lower.item() == 0
    out.loss.backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, t([[0, 0, 0], [0.5, 0.5, 0]]))


def test_gspo_global_num_seqs_split_invariance() -> None:
    gen = torch.Generator().manual_seed(8)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    old, new, adv = (torch.randn(4, 4, generator=gen) * 0.01 for _ in range(3))
    full = gspo_policy_loss(new, old, adv, mask, global_num_seqs=4)
    parts = [
        gspo_policy_loss(new[s], old[s], adv[s], mask[s], global_num_seqs=4)
        for s in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(parts[0].loss + parts[1].loss, full.loss)


# ---------------------------------------------------------------------------------------------- value loss


def test_value_loss_hand_case() -> None:
    # t0: v 1, v_old 0 -> clipped 0.5; errors 1 and 0.25 -> 1 (unclipped larger).
    # t1: v 2.5, v_old 1.8 -> clipped 2.3; errors 0.25 and 0.49 -> 0.49 (clipped larger).
    # t2 masked (NaN). loss = 0.5 * mean(1, 0.49); clip fraction 1/2.
    values = t([[1.0, 2.5, NAN]]).requires_grad_()
    out = value_loss(values, t([[0.0, 1.8, NAN]]), t([[0.0, 3.0, NAN]]), t([[1, 1, 0]]), clip_range_value=0.5)
    torch.testing.assert_close(out.loss, scalar(0.5 * (1 + 0.49) / 2))
    torch.testing.assert_close(out.clip_frac, scalar(0.5))
    out.loss.backward()
    # t0: d/dv 0.5 * (v - R)^2 / 2 = (1 - 0) / 2; t1: the clipped branch is constant in v.
    assert values.grad is not None
    torch.testing.assert_close(values.grad, t([[0.5, 0.0, 0.0]]))


def test_value_loss_errors() -> None:
    with pytest.raises(ValueError, match="returns"):
        value_loss(torch.ones(2, 3), torch.ones(2, 3), torch.ones(3, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_range_value"):
        value_loss(
            torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), clip_range_value=-1
        )
