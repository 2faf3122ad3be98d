"""Outcome rewards and the estimator dispatch of the critic-free steps (``algo/advantages.py``)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo import compute_grpo_advantages, compute_rloo_advantages
from mcore_rl.algo.advantages import compute_advantages, outcome_rewards
from mcore_rl.algo.settings import AdvEstimator


def test_outcome_rewards_sit_on_the_last_response_position() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    rewards = outcome_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert rewards.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0], [-1, 0, 0, 0]]


def test_advantage_dispatch_matches_the_algorithms_and_rejects_unknown_names() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    scores, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    rewards = outcome_rewards(scores, mask)
    grpo = compute_advantages("grpo", scores, mask, groups)
    assert torch.equal(grpo, compute_grpo_advantages(rewards, mask, [0, 0, 1, 1]).advantages)
    dr = compute_advantages("dr_grpo", scores, mask, groups)
    assert dr[0, 1].item() == pytest.approx(0.5) and dr[1, 1].item() == pytest.approx(-0.5)
    rloo = compute_advantages("rloo", scores, mask, groups)
    assert torch.equal(rloo, compute_rloo_advantages(rewards, mask, [0, 0, 1, 1]).advantages)
    for name in (e for e in AdvEstimator if e is not AdvEstimator.GAE):
        adv = compute_advantages(name, scores, mask, groups)
        assert adv.shape == mask.shape and bool((adv[mask == 0] == 0).all())
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator: unknown 'ppo'"):
        compute_advantages("ppo", scores, mask, groups)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("score", [1.1, 2.2, 0.7, -0.35, 1 / 3])
def test_a_group_of_equal_fractional_scores_has_no_advantage(name: str, score: float) -> None:
    # A rule score plus a tool reward of 0.1 is 1.1 for every sample of a group that all solved it: float32
    # sums of 16 such scores miss their mean by an ulp, and GRPO's std was that ulp too (advantages -0.106).
    groups = torch.tensor([0] * 16 + [1] * 4)
    scores = torch.cat([torch.full((16,), score), torch.tensor([0.0, 1.0, 0.5, 1.0])])
    mask = torch.ones(20, 3)
    adv = compute_advantages(name, scores, mask, groups)
    assert bool((adv[:16] == 0).all())
    assert bool((adv[16:] != 0).any())


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_an_empty_response_keeps_its_score_in_its_groups_statistics(name: str) -> None:
    """A response with no tokens has no position for its score: its group's mean and std read 0 for it
    (GRPO row 0: 0.866 where the four scores give 0.783)."""
    scores, groups = torch.tensor([1.0, 0.0, 1.0, -1.0]), torch.tensor([0, 0, 0, 0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    with_empty = compute_advantages(name, scores, mask, groups)
    reference = compute_advantages(name, scores, torch.ones_like(mask), groups)  # every response with tokens
    for row in range(3):
        assert with_empty[row, 0].item() == pytest.approx(reference[row, 0].item(), rel=1e-6)
    assert bool((with_empty[3] == 0).all())
