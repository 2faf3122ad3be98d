"""Advantage estimators: pure functions from token-level rewards to token-level advantages.

Each function matches the estimator of the same name in verl's `verl/trainer/ppo/core_algos.py` at every valid
(mask = 1) position, up to floating point. Shared conventions:

* `rewards`, `values`, `mask`: [B, T] over response tokens only; `mask` is 0/1 (bool or float). Rewards are
  usually zero except at the last valid token (outcome reward), but any token-level rewards are accepted.
* Masked-out positions of every returned tensor are exactly 0, and NaN/inf placed there in the inputs is
  ignored (verl leaves carried or shifted values there; no loss reads them).
* A sequence's *score* is the sum of its rewards over valid tokens (verl sums the whole row, which is the same
  thing whenever rewards are 0 outside the mask, as reward managers write them).
* `group_ids`: one hashable id per sequence (length B; a 1-D tensor, numpy array or sequence of ints/strings),
  e.g. the prompt uid shared by the n samples of one prompt. Members of a group need not be contiguous.
* Results are computed without autograd (advantages are constants for the policy loss) in float32 (float64
  inputs stay float64).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mcore_rl.algo.masked import (
    check_mask,
    check_shape,
    compute_dtype,
    masked_sum,
    masked_whiten,
    zero_masked,
)
from mcore_rl.algo.settings import AdvEstimator

GroupIds = torch.Tensor | Sequence[Hashable] | Any  # Any: numpy arrays, without importing numpy here


@dataclass(frozen=True)
class AdvantageOutput:
    """Result of an advantage estimator."""

    advantages: torch.Tensor
    """[B, T] advantages; 0 at masked-out positions."""
    returns: torch.Tensor
    """[B, T] value targets (GAE: raw advantages + values) or, for critic-free estimators, what verl returns in
    that slot; 0 at masked-out positions."""


def _group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map each sequence's group id to a dense group number: ([B] long tensor, number of groups)."""
    if isinstance(group_ids, torch.Tensor) and group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
    ids = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries, expected one per sequence ({batch_size})")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(gid, len(dense)) for gid in ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(dense)


def _group_mean_std(
    scores: torch.Tensor, index: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, unbiased group std, group size), each [B].

    A singleton group gets mean 0 and std 1, as verl: its advantage is then its raw score (GRPO) rather than 0.
    The sums run in float64 on each score's distance from its group's highest, so a group of equal scores has
    its score as mean and std 0 exactly: its advantages are 0, not a rounding error divided by a std of the
    same size (equal scores of 1.1 in a float32 group of 16 gave every member -0.106).
    """
    wide = scores.to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    top = zeros.scatter_reduce(0, index, wide, "amax", include_self=False)
    shifted = wide - top[index]
    counts = zeros.index_add(0, index, torch.ones_like(wide))
    shift_mean = zeros.index_add(0, index, shifted) / counts
    sq_dev = zeros.index_add(0, index, (shifted - shift_mean[index]).square())
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()
    multi = counts > 1
    mean = torch.where(multi, top + shift_mean, torch.zeros_like(top))
    std = torch.where(multi, std, torch.ones_like(std))
    return mean[index].to(scores.dtype), std[index].to(scores.dtype), counts[index].to(scores.dtype)


def _scores(
    rewards: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate (rewards, mask) and return (bool mask [B, T], score per sequence [B]): ``scores`` when given
    (an outcome reward: a response with no tokens has no position to hold its score, and its group's
    statistics still count it, as verl's do), else the rewards summed over the mask."""
    mask = check_mask(mask)
    check_shape("rewards", rewards, mask.shape)
    if scores is not None:
        check_shape("scores", scores, mask.shape[:1])
        return mask, scores.to(rewards.dtype)
    return mask, masked_sum(rewards, mask, dim=-1)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sequence's value on its valid tokens, 0 elsewhere."""
    return torch.where(
        mask, per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device)
    )


@torch.no_grad()
def compute_gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> AdvantageOutput:
    """Generalised advantage estimation (Schulman et al. 2016), verl's `compute_gae_advantage_return`.

    Reverse scan over t: `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`, where
    V_next / A_next are those of the next *valid* token: a masked-out position (an observation token inside a
    multi-turn response, or padding) carries both through unchanged, so the TD chain skips it.
    Returns `returns = A + V` (raw advantages) and advantages whitened over valid tokens (unbiased variance).

    Shapes: rewards, values, mask [B, T] -> AdvantageOutput([B, T], [B, T]).
    """
    mask = check_mask(mask)
    check_shape("rewards", rewards, mask.shape)
    check_shape("values", values, mask.shape)
    r, v = zero_masked(rewards, mask), zero_masked(values, mask).to(compute_dtype(rewards))
    batch_size, length = mask.shape
    next_value = torch.zeros(batch_size, dtype=r.dtype, device=r.device)
    last_adv = torch.zeros_like(next_value)
    raw = torch.zeros_like(r)
    for t in reversed(range(length)):
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last_adv
        next_value = torch.where(mask[:, t], v[:, t], next_value)
        last_adv = torch.where(mask[:, t], adv_t, last_adv)
        raw[:, t] = last_adv
    returns = torch.where(mask, raw + v, torch.zeros_like(raw))
    return AdvantageOutput(advantages=masked_whiten(raw, mask), returns=returns)


@torch.no_grad()
def compute_grpo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    scores: torch.Tensor | None = None,
) -> AdvantageOutput:
    """GRPO outcome advantage (Shao et al. 2024), verl's `compute_grpo_outcome_advantage`.

    `A_i = (s_i - mean_g) / (std_g + eps)` with s_i the sequence score and mean/std (unbiased) over the
    sequence's group g; a singleton group uses mean 0, std 1. `norm_by_std=False` gives Dr.GRPO (Liu et al.
    2025): `A_i = s_i - mean_g`. A_i is broadcast over the sequence's valid tokens.

    Shapes: rewards, mask [B, T]; group_ids length B -> AdvantageOutput(A, A), both [B, T].
    """
    mask, scores = _scores(rewards, mask, scores)
    index, num_groups = _group_index(group_ids, mask.shape[0], scores.device)
    mean, std, _ = _group_mean_std(scores, index, num_groups)
    per_seq = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    advantages = _broadcast(per_seq, mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@torch.no_grad()
def compute_rloo_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: GroupIds, *, scores: torch.Tensor | None = None
) -> AdvantageOutput:
    """RLOO advantage (Ahmadian et al. 2024), verl's `compute_rloo_outcome_advantage`.

    For a group of n > 1 sequences, `A_i = s_i - mean of the other n-1 scores`, computed as verl does:
    `s_i * n/(n-1) - mean_g * n/(n-1)`. A singleton group keeps its raw score. Broadcast over valid tokens.

    Shapes: rewards, mask [B, T]; group_ids length B -> AdvantageOutput(A, A), both [B, T].
    """
    mask, scores = _scores(rewards, mask, scores)
    index, num_groups = _group_index(group_ids, mask.shape[0], scores.device)
    mean, _, n = _group_mean_std(scores, index, num_groups)
    loo = scores * n / (n - 1) - mean * n / (n - 1)
    advantages = _broadcast(torch.where(n > 1, loo, scores), mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@torch.no_grad()
def compute_reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025), verl's `compute_reinforce_plus_plus_outcome_advantage`.

    Discounted return-to-go over valid tokens, `G_t = r_t + gamma * G_next` where `next` is the next *valid*
    token, then whitened over all valid tokens of the batch. A masked-out position inside a response (a tool
    observation between two turns) carries the running return through unchanged and costs no discount step,
    so an outcome reward reaches every earlier turn (verl fixed its reset-at-every-gap scan the same way,
    verl-project/verl#7278); trailing padding holds nothing because each row's scan starts at 0. This is the
    convention `compute_gae_advantages` uses for values and advantages.

    Shapes: rewards, mask [B, T] -> AdvantageOutput(whitened G, G), both [B, T]; G is 0 at masked positions.
    """
    mask, _ = _scores(rewards, mask)
    r = zero_masked(rewards, mask)
    running = torch.zeros(mask.shape[0], dtype=r.dtype, device=r.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = torch.where(mask, returns, torch.zeros_like(returns))
    return AdvantageOutput(advantages=masked_whiten(returns, mask), returns=returns)


@torch.no_grad()
def compute_reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: GroupIds, *, scores: torch.Tensor | None = None
) -> AdvantageOutput:
    """REINFORCE++-baseline, verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`.

    The group mean score is subtracted first (singleton group: mean 0), the result is broadcast over the valid
    tokens and then whitened over all valid tokens of the batch. (As in verl there is no discounting here.)

    Shapes: rewards, mask [B, T]; group_ids length B -> AdvantageOutput(A, A), both [B, T].
    """
    mask, scores = _scores(rewards, mask, scores)
    index, num_groups = _group_index(group_ids, mask.shape[0], scores.device)
    mean, _, _ = _group_mean_std(scores, index, num_groups)
    advantages = masked_whiten(_broadcast(scores - mean, mask), mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@torch.no_grad()
def compute_remax_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, baseline_scores: torch.Tensor
) -> AdvantageOutput:
    """ReMax (Li et al. 2024), verl's `compute_remax_outcome_advantage`.

    `returns_t` = undiscounted reward-to-go over valid tokens; `A_t = returns_t - b` where b is the score of the
    greedy response to the same prompt. With an outcome reward, `A_t = score - greedy score` on every valid token.

    Shapes: rewards, mask [B, T]; baseline_scores [B] -> AdvantageOutput([B, T], [B, T]).
    """
    mask, _ = _scores(rewards, mask)
    check_shape("baseline_scores", baseline_scores, mask.shape[:1])
    r = zero_masked(rewards, mask)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    advantages = returns - baseline_scores.to(r.dtype).unsqueeze(-1)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    return AdvantageOutput(
        advantages=torch.where(mask, advantages, zero), returns=torch.where(mask, returns, zero)
    )


def outcome_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[N, S]: each sequence's score on its last response position, 0 elsewhere (an outcome reward)."""
    positions = torch.arange(response_mask.shape[1])
    last = torch.where(response_mask > 0, positions, -1).max(dim=1).values  # -1 for an empty response
    rewards = torch.zeros(response_mask.shape)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


def compute_advantages(
    estimator: AdvEstimator | str,
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    norm_adv_by_std: bool = True,
    gamma: float = 1.0,
) -> Tensor:
    """[N, S] advantages of outcome ``scores`` [N] by a critic-free ``estimator`` (GAE needs values: the PPO
    step calls :func:`compute_gae_advantages` itself)."""
    try:
        kind = AdvEstimator(estimator)
    except ValueError:
        valid = ", ".join(e.value for e in AdvEstimator)
        raise ValueError(f"algorithm.adv_estimator: unknown {estimator!r}; valid: {valid}") from None
    rewards = outcome_rewards(scores, response_mask)
    groups = group_ids.tolist()
    given = scores.to(rewards.dtype)  # the group statistics read the scores, empty responses' included
    if kind in (AdvEstimator.GRPO, AdvEstimator.DR_GRPO):
        norm = norm_adv_by_std and kind is AdvEstimator.GRPO
        return compute_grpo_advantages(
            rewards, response_mask, groups, norm_by_std=norm, scores=given
        ).advantages
    if kind is AdvEstimator.RLOO:
        return compute_rloo_advantages(rewards, response_mask, groups, scores=given).advantages
    if kind is AdvEstimator.REINFORCE_PLUS_PLUS:
        return compute_reinforce_pp_advantages(rewards, response_mask, gamma=gamma).advantages
    if kind is AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE:
        return compute_reinforce_pp_baseline_advantages(
            rewards, response_mask, groups, scores=given
        ).advantages
    raise ValueError(
        f"algorithm.adv_estimator={kind.value}: an outcome-reward step cannot run it (needs a critic)"
    )
