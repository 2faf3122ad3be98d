"""Advantage estimators against hand-computed cases (verl's definitions) and their properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mcore_rl.algo import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    masked_var,
    masked_whiten,
)

NAN = float("nan")


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=1e-6)


# Six sequences in four groups; members of q1 and q2 are interleaved. Scores (sum of token rewards over valid
# tokens): q1 = {1, 0, 0} (rows 0, 2, 3), q2 = {0.5, 0.5} (rows 1, 4), q3 = {0.7} (row 5, a singleton).
GROUP_IDS = ["q1", "q2", "q1", "q1", "q2", "q3"]
GROUP_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
GROUP_REWARDS = t([[0.5, 0.5, NAN], [0, 0, 0.5], [0, NAN, NAN], [0, 0, 0], [0.25, 0.25, NAN], [0, 0.2, 0.5]])


def per_seq(advantages: torch.Tensor) -> torch.Tensor:
    """The per-sequence advantage broadcast on valid tokens (checking it is constant there)."""
    mask = GROUP_MASK.bool()
    first = advantages[:, 0]
    torch.testing.assert_close(advantages, torch.where(mask, first.unsqueeze(-1), torch.zeros(())))
    return first


def test_masked_whiten_hand_case() -> None:
    # valid values 1, 2, 3: mean 2, unbiased variance 1 -> -1, 0, 1; the masked 100 is ignored and zeroed.
    out = masked_whiten(t([[1, 2, 3, 100]]), t([[1, 1, 1, 0]]))
    assert_close(out, [[-1, 0, 1, 0]])


def test_masked_var_hand_case() -> None:
    # Valid {1, 2, 3}: mean 2, biased var 2/3, unbiased 1. The masked 100 and a NaN in padding change nothing.
    values, mask = t([[1, 2, 3, 100], [NAN, NAN, NAN, NAN]]), t([[1, 1, 1, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(1.0))
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(2.0 / 3.0))
    torch.testing.assert_close(masked_var(t([[5, 7]]), t([[1, 0]]), unbiased=False), torch.tensor(0.0))


@pytest.mark.parametrize(("mask", "unbiased"), [([[1, 0]], True), ([[0, 0]], True), ([[0, 0]], False)])
def test_masked_var_refuses_too_few_tokens(mask: list[list[float]], unbiased: bool) -> None:
    with pytest.raises(ValueError, match="masked_var needs at least"):
        masked_var(t([[1, 2]]), t(mask), unbiased=unbiased)


def test_masked_whiten_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        masked_whiten(t([[1, 2]]), t([[1, 0]]))


def test_gae_hand_case() -> None:
    # gamma = lam = 0.5, V = (0.5, 1, 2), reward 1 at the end:
    #   t=2: delta = 1 - 2 = -1                 A2 = -1
    #   t=1: delta = 0.5 * 2 - 1 = 0            A1 = 0 + 0.25 * -1 = -0.25
    #   t=0: delta = 0.5 * 1 - 0.5 = 0          A0 = 0.25 * -0.25 = -0.0625
    # returns = A + V = (0.4375, 0.75, 1.0); A whitened: mean -0.4375, unbiased var 0.24609375.
    out = compute_gae_advantages(t([[0, 0, 1]]), t([[0.5, 1, 2]]), t([[1, 1, 1]]), gamma=0.5, lam=0.5)
    assert_close(out.returns, [[0.4375, 0.75, 1.0]])
    assert_close(out.advantages, [[0.75592895, 0.37796447, -1.13389342]])


def test_gae_masked_positions_carry_value_and_advantage() -> None:
    # An observation token at t=1 and padding at t=3, both holding NaN. gamma = lam = 1:
    #   t=2: delta = 1 + 0 - 2 = -1, A2 = -1      (t=3 skipped: next value 0)
    #   t=0: delta = 0 + V2 - V0 = 2 - 1 = 1, A0 = 1 + A2 = 0   (t=1 skipped: carries V2 = 2 and A2 = -1)
    # returns = (0 + 1, -, -1 + 2, -); A whitened over {0, -1}: mean -0.5, unbiased var 0.5.
    out = compute_gae_advantages(t([[0, NAN, 1, NAN]]), t([[1, NAN, 2, NAN]]), t([[1, 0, 1, 0]]))
    assert_close(out.returns, [[1, 0, 1, 0]])
    assert_close(out.advantages, [[math.sqrt(0.5), 0, -math.sqrt(0.5), 0]])


def test_gae_fully_masked_row_changes_nothing_else() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    ref = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    padded_mask = torch.cat([mask, torch.zeros(1, 5)])
    padded = compute_gae_advantages(
        torch.cat([rewards, torch.full((1, 5), NAN)]),
        torch.cat([values, torch.full((1, 5), NAN)]),
        padded_mask,
        gamma=0.9,
        lam=0.95,
    )
    torch.testing.assert_close(padded.advantages[:3], ref.advantages)
    torch.testing.assert_close(padded.returns[:3], ref.returns)
    assert padded.advantages[3].abs().sum() == 0 and padded.returns[3].abs().sum() == 0


def test_grpo_hand_case() -> None:
    # q1: mean 1/3, unbiased std sqrt(1/3) -> (2/3)/(std + 1e-6), (-1/3)/(std + 1e-6);
    # q2: std 0 -> 0; q3 (singleton): mean 0, std 1 -> 0.7 / (1 + 1e-6).
    out = compute_grpo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS)
    expected = [1.15469854, 0.0, -0.57734927, -0.57734927, 0.0, 0.69999930]
    torch.testing.assert_close(per_seq(out.advantages), torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert out.returns is out.advantages


def test_dr_grpo_skips_std() -> None:
    out = compute_grpo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS, norm_by_std=False)
    expected = [2 / 3, 0.0, -1 / 3, -1 / 3, 0.0, 0.7]
    torch.testing.assert_close(per_seq(out.advantages), torch.tensor(expected))


@pytest.mark.parametrize("as_type", ["list", "numpy", "tensor"])
def test_group_ids_of_any_kind(as_type: str) -> None:
    int_ids = [7, 3, 7, 7, 3, 11]
    ids = {"list": int_ids, "numpy": np.array(int_ids), "tensor": torch.tensor(int_ids)}[as_type]
    ref = compute_grpo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS).advantages
    torch.testing.assert_close(compute_grpo_advantages(GROUP_REWARDS, GROUP_MASK, ids).advantages, ref)


def test_grpo_advantages_sum_to_zero_per_group() -> None:
    gen = torch.Generator().manual_seed(1)
    num_groups, group_size, length = 5, 4, 6
    batch = num_groups * group_size
    rewards = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).float()
    ids = torch.randperm(batch, generator=gen) % num_groups  # shuffled, non-contiguous groups
    for norm_by_std in (True, False):
        seq_adv = compute_grpo_advantages(rewards, mask, ids, norm_by_std=norm_by_std).advantages[:, 0]
        for g in range(num_groups):
            assert abs(seq_adv[ids == g].sum().item()) < 1e-5
        if norm_by_std:  # each group is standardised: unbiased std 1 (up to eps)
            for g in range(num_groups):
                assert abs(seq_adv[ids == g].std().item() - 1.0) < 1e-4


def test_rloo_hand_case() -> None:
    # q1: 1 - mean(0, 0) = 1, 0 - mean(1, 0) = -0.5 (twice); q2: 0.5 - 0.5 = 0; q3 singleton keeps 0.7.
    out = compute_rloo_advantages(GROUP_REWARDS, GROUP_MASK, GROUP_IDS)
    torch.testing.assert_close(per_seq(out.advantages), torch.tensor([1.0, 0.0, -0.5, -0.5, 0.0, 0.7]))


def _whiten_by_hand(values: list[float]) -> list[float]:
    """(x - mean) / sqrt(unbiased var + 1e-8), computed with the statistics module (independent of our code)."""
    import statistics

    mean, var = statistics.fmean(values), statistics.variance(values)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in values]


def test_reinforce_pp_hand_case() -> None:
    # gamma 0.5. Row 0: G = (1 + 0.5 * 1, 0 + 0.5 * 2, 2) = (1.5, 1, 2). Row 1: padding at t=2: G = (0 + 0.5 * 4,
    # 4). Row 2: the hole at t=1 (a tool observation) carries the return through without a discount step, so
    # G0 = 0 + 0.5 * 2 = 1 (verl before #7278 restarted it: G0 = 0).
    rewards = t([[1, 0, 2], [0, 4, NAN], [0, NAN, 2]])
    out = compute_reinforce_pp_advantages(rewards, t([[1, 1, 1], [1, 1, 0], [1, 0, 1]]), gamma=0.5)
    assert_close(out.returns, [[1.5, 1, 2], [2, 4, 0], [1, 0, 2]])
    w = _whiten_by_hand([1.5, 1, 2, 2, 4, 1, 2])
    assert_close(out.advantages, [[w[0], w[1], w[2]], [w[3], w[4], 0], [w[5], 0, w[6]]], atol=1e-5)


def test_reinforce_pp_observation_span_equals_compact_response() -> None:
    # verl-project/verl#7278: [act, act, obs, obs, act, act] with the outcome reward on the last token must give
    # the actions the same returns as the compact [act, act, act, act] (gamma 1), and 0 on the observations.
    compact = compute_reinforce_pp_advantages(t([[0, 0, 0, 1]]), t([[1, 1, 1, 1]]), gamma=1.0)
    expanded = compute_reinforce_pp_advantages(t([[0, 0, 0, 0, 0, 1]]), t([[1, 1, 0, 0, 1, 1]]), gamma=1.0)
    assert_close(expanded.returns, [[1, 1, 0, 0, 1, 1]])
    torch.testing.assert_close(expanded.returns[:, [0, 1, 4, 5]], compact.returns)
    # With a discount, the observation costs no step: (model, obs, model) with gamma 0.5 -> (0.5, 0, 1).
    discounted = compute_reinforce_pp_advantages(t([[0, 0, 1]]), t([[1, 0, 1]]), gamma=0.5)
    assert_close(discounted.returns, [[0.5, 0, 1]])


def test_reinforce_pp_baseline_hand_case() -> None:
    # Scores 1, 3 (group a, mean 2) and 5 (singleton b, mean 0): -1, 1, 5 broadcast on valid tokens, then
    # whitened over {-1, -1, 1, 5, 5, 5}: mean 7/3, unbiased var 9.0666...
    rewards = t([[0, 1, NAN], [3, NAN, NAN], [1, 2, 2]])
    out = compute_reinforce_pp_baseline_advantages(
        rewards, t([[1, 1, 0], [1, 0, 0], [1, 1, 1]]), ["a", "a", "b"]
    )
    assert_close(
        out.advantages,
        [[-1.10701861, -1.10701861, 0], [-0.44280744, 0, 0], [0.88561489, 0.88561489, 0.88561489]],
    )


def test_remax_hand_case() -> None:
    # Reward-to-go minus the greedy response's score.
    out = compute_remax_advantages(
        t([[0, 0, 1], [0.5, 0.5, NAN]]), t([[1, 1, 1], [1, 1, 0]]), t([[0.25, 2]])[0]
    )
    assert_close(out.returns, [[1, 1, 1], [1, 0.5, 0]])
    assert_close(out.advantages, [[0.75, 0.75, 0.75], [-1, -1.5, 0]])


ESTIMATORS = {
    "gae": lambda r, m: compute_gae_advantages(r, -r, m, gamma=0.9, lam=0.95),
    "grpo": lambda r, m: compute_grpo_advantages(r, m, [0, 1, 0, 1, 0, 1]),
    "rloo": lambda r, m: compute_rloo_advantages(r, m, [0, 1, 0, 1, 0, 1]),
    "reinforce_pp": lambda r, m: compute_reinforce_pp_advantages(r, m, gamma=0.9),
    "reinforce_pp_baseline": lambda r, m: compute_reinforce_pp_baseline_advantages(r, m, [0, 1, 0, 1, 0, 1]),
    "remax": lambda r, m: compute_remax_advantages(r, m, torch.arange(6.0)),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_nan_in_masked_positions_does_not_leak(name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(6, 5, generator=gen)
    mask = t(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    )
    clean = ESTIMATORS[name](torch.where(mask.bool(), rewards, torch.zeros(())), mask)
    dirty = ESTIMATORS[name](torch.where(mask.bool(), rewards, torch.full((), NAN)), mask)
    for field in ("advantages", "returns"):
        out = getattr(dirty, field)
        assert torch.isfinite(out).all(), field
        assert (out[mask == 0] == 0).all(), field
        torch.testing.assert_close(out, getattr(clean, field))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_bf16_inputs_compute_in_float32(name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 5, generator=gen).to(torch.bfloat16)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).to(torch.bool)
    mask[:, 0] = True
    out_bf16 = ESTIMATORS[name](rewards, mask)
    out_fp32 = ESTIMATORS[name](rewards.float(), mask.float())
    assert out_bf16.advantages.dtype == torch.float32
    torch.testing.assert_close(out_bf16.advantages, out_fp32.advantages)


def test_shape_and_group_errors() -> None:
    with pytest.raises(ValueError, match="values"):
        compute_gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rewards"):
        compute_grpo_advantages(torch.zeros(2, 4), torch.ones(2, 3), [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        compute_grpo_advantages(torch.zeros(2, 3), torch.ones(2, 3), [0, 0, 1])
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_remax_advantages(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="mask"):
        compute_rloo_advantages(torch.zeros(2, 3), torch.ones(6), [0, 1])
