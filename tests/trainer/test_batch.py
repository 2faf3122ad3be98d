"""Pure batch arithmetic of the RL step, against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import compute_grpo_advantages, compute_rloo_advantages, ppo_policy_loss
from mcore_rl.algo.advantages import compute_advantages, outcome_rewards
from mcore_rl.algo.agreement import prob_agreement, truncated_importance_weights
from mcore_rl.algo.settings import AdvEstimator
from mcore_rl.engine.packing.micro_batches import mini_batch_slices
from mcore_rl.engine.rollout import GenerationOutput
from mcore_rl.engine.rollout.batch import common_width, rollout_batch


def _two_prompts() -> tuple[list[list[int]], GenerationOutput]:
    out = GenerationOutput(
        prompt_index=torch.tensor([0, 0, 1]),
        token_ids=torch.tensor([[20, 21, 22], [23, 9, 9], [30, 31, 9]]),
        log_probs=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 5.0, 5.0], [-0.5, -0.6, 5.0]]),
        lengths=torch.tensor([3, 1, 2]),
        finish_reasons=["length", "stop", "stop"],
    )
    return [[5, 6, 7], [8, 9]], out


def test_rollout_batch_puts_each_response_quantity_on_the_position_that_predicts_it() -> None:
    prompts, out = _two_prompts()
    batch = rollout_batch(prompts, torch.tensor([10, 11]), out, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 20, 21, 22], [5, 6, 7, 23, 0, 0], [8, 9, 30, 31, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert torch.allclose(batch.rollout_log_probs[0, 2:5], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.rollout_log_probs[1].tolist() == pytest.approx(
        [0, 0, -0.4, 0, 0, 0]
    )  # padding's 5.0 dropped
    assert batch.prompt_index.tolist() == [10, 10, 11]
    assert batch.responses() == [[20, 21, 22], [23], [30, 31]]


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


def test_token_mult_prob_error_is_nemo_rl_s_token_mean_of_exp_abs_difference() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    rollout = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.0, -2.5, 0.0], [-0.3, 0.0, 0.0]])
    agreement = prob_agreement(rollout, trainer, mask)
    expected = (1 + math.exp(0.5) + math.exp(0.2)) / 3  # the masked 9.0 is ignored
    assert agreement.token_mult_prob_error == pytest.approx(expected)
    assert agreement.worst(1)[0][0] == 0 and agreement.per_sequence[1].item() == pytest.approx(math.exp(0.2))
    assert prob_agreement(rollout, rollout, mask).token_mult_prob_error == 1.0


def test_mini_batch_slices_split_rows_evenly_or_name_the_field() -> None:
    assert mini_batch_slices(8, 2) == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="ppo_mini_batch_size: 6 rows per data-parallel rank"):
        mini_batch_slices(6, 4)


def test_replica_shards_of_other_widths_are_padded_to_concatenate_with_their_rows_intact() -> None:
    from mcore_rl.controller import concat_records

    prompts, out = _two_prompts()
    wide = rollout_batch(prompts, torch.tensor([0, 1]), out, pad_id=0)  # S = 3 + 3, T = 3
    short = GenerationOutput(
        prompt_index=torch.tensor([0]),
        token_ids=torch.tensor([[40]]),
        log_probs=torch.tensor([[-0.7]]),
        lengths=torch.tensor([1]),
        finish_reasons=["stop"],
    )
    narrow = rollout_batch([[11]], torch.tensor([2]), short, pad_id=0)  # S = 2, T = 1
    joined = concat_records(common_width([wide, narrow], pad_id=0))
    assert joined.tokens.shape == (4, 6) and joined.response_ids.shape == (4, 3)
    assert joined.tokens[3].tolist() == [11, 40, 0, 0, 0, 0]
    assert joined.response_mask[3].tolist() == [1.0, 0, 0, 0, 0, 0]
    assert joined.rollout_log_probs[3, 0].item() == pytest.approx(-0.7)
    assert joined.responses() == [*wide.responses(), [40]]
    assert torch.equal(joined.tokens[:3], wide.tokens) and joined.prompt_index.tolist() == [0, 0, 1, 2]


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
