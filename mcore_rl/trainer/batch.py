"""Pure batch arithmetic of the RL step: rollout output -> position-aligned records, rewards -> advantages,
the log-prob agreement metric, mini/micro-batch slicing. No processes, no Ray; tested on CPU.

See :mod:`mcore_rl.types` for the position alignment every ``[N, S]`` tensor follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algo import (
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
)
from mcore_rl.engine.rollout.base import GenerationOutput
from mcore_rl.types import RolloutBatch

ADV_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def rollout_batch(
    prompt_ids: Sequence[Sequence[int]], prompt_index: Tensor, out: GenerationOutput, pad_id: int
) -> RolloutBatch:
    """Join prompts and sampled responses into position-aligned rows, without a per-row Python loop.

    ``prompt_ids[j]`` is the j-th prompt given to the engine and ``prompt_index[j]`` its number in the step;
    ``out.prompt_index`` says which j each sequence continues.
    """
    local = out.prompt_index.long()
    lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    prompt_len = lengths[local]  # [N]
    num, new = out.token_ids.shape
    width = int(lengths.max()) + new
    padded = torch.full((len(prompt_ids), int(lengths.max())), pad_id, dtype=torch.long)
    for j, ids in enumerate(prompt_ids):  # once per prompt, not per sample
        padded[j, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    tokens = torch.full((num, width), pad_id, dtype=torch.long)
    tokens[:, : padded.shape[1]] = padded[local]
    steps = torch.arange(new)
    valid = steps[None, :] < out.lengths[:, None]  # [N, T]
    columns = prompt_len[:, None] + steps[None, :]  # where response token j sits
    tokens.scatter_(1, columns, torch.where(valid, out.token_ids, pad_id))
    mask = torch.zeros(num, width).scatter_(1, columns - 1, valid.float())
    log_probs = torch.zeros(num, width).scatter_(1, columns - 1, torch.where(valid, out.log_probs, 0.0))
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        rollout_log_probs=log_probs,
        response_ids=torch.where(valid, out.token_ids, pad_id),
        response_lengths=out.lengths.long(),
        prompt_index=prompt_index.long()[local],
    )


def common_width(batches: Sequence[RolloutBatch], pad_id: int) -> list[RolloutBatch]:
    """The rollout shards of several replicas, right-padded to the widest one's ``S`` and ``T`` so that they
    concatenate: replicas see prompts of other lengths and stop after other numbers of tokens."""
    seq = max(b.tokens.shape[1] for b in batches)
    new = max(b.response_ids.shape[1] for b in batches)

    def pad(t: Tensor, width: int, value: float) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return [
        RolloutBatch(
            tokens=pad(b.tokens, seq, pad_id),
            response_mask=pad(b.response_mask, seq, 0.0),
            rollout_log_probs=pad(b.rollout_log_probs, seq, 0.0),
            response_ids=pad(b.response_ids, new, pad_id),
            response_lengths=b.response_lengths,
            prompt_index=b.prompt_index,
        )
        for b in batches
    ]


def outcome_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[N, S]: each sequence's score on its last response position, 0 elsewhere (an outcome reward)."""
    positions = torch.arange(response_mask.shape[1])
    last = torch.where(response_mask > 0, positions, -1).max(dim=1).values  # -1 for an empty response
    rewards = torch.zeros(response_mask.shape)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


def compute_advantages(
    estimator: str,
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    norm_adv_by_std: bool = True,
    gamma: float = 1.0,
) -> Tensor:
    """[N, S] advantages of outcome ``scores`` [N] by ``estimator`` (one of :data:`ADV_ESTIMATORS`)."""
    rewards = outcome_rewards(scores, response_mask)
    groups = group_ids.tolist()
    if estimator in ("grpo", "dr_grpo"):
        norm = norm_adv_by_std and estimator == "grpo"
        return compute_grpo_advantages(rewards, response_mask, groups, norm_by_std=norm).advantages
    if estimator == "rloo":
        return compute_rloo_advantages(rewards, response_mask, groups).advantages
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_pp_advantages(rewards, response_mask, gamma=gamma).advantages
    if estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_pp_baseline_advantages(rewards, response_mask, groups).advantages
    raise ValueError(f"algorithm.adv_estimator: unknown {estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}")


@dataclass(frozen=True)
class ProbAgreement:
    """NeMo-RL's ``token_mult_prob_error`` and where it is worst."""

    token_mult_prob_error: float
    """Mean over response tokens of ``exp(|rollout log-prob - trainer log-prob|)``; 1.0 is perfect."""
    per_sequence: Tensor
    """[N] the same mean within each sequence (0 for an empty response)."""

    def worst(self, k: int) -> list[tuple[int, float]]:
        """The ``k`` worst sequences as (row, per-sequence error), worst first."""
        values, rows = self.per_sequence.topk(min(k, self.per_sequence.numel()))
        return list(zip(rows.tolist(), values.tolist(), strict=True))


def prob_agreement(
    rollout_log_probs: Tensor, trainer_log_probs: Tensor, response_mask: Tensor
) -> ProbAgreement:
    """``token_mult_prob_error`` (token-normalised, as NeMo-RL) and its per-sequence breakdown."""
    mask = response_mask > 0
    error = torch.where(mask, (rollout_log_probs - trainer_log_probs).abs().exp(), 0.0)
    counts = mask.sum(dim=1)
    per_seq = error.sum(dim=1) / counts.clamp(min=1)
    total = float(error.sum() / counts.sum().clamp(min=1))
    return ProbAgreement(total, per_seq)


def mini_batch_slices(num_rows: int, num_mini_batches: int) -> list[slice]:
    """Contiguous row slices of one data-parallel shard, one per mini-batch (the k-th mini-batch of the
    step is the k-th slice of every shard)."""
    if num_mini_batches < 1 or num_rows % num_mini_batches:
        raise ValueError(
            f"algorithm.ppo_mini_batch_size: {num_rows} rows per data-parallel rank do not split into "
            f"{num_mini_batches} mini-batches"
        )
    size = num_rows // num_mini_batches
    return [slice(i * size, (i + 1) * size) for i in range(num_mini_batches)]


@dataclass(frozen=True)
class ImportanceWeights:
    """Truncated importance weights of a lagged rollout (TIS) and how much truncation they needed."""

    weights: Tensor
    """[N, S] float32: ``min(exp(old - rollout log-prob), threshold)`` on response tokens, 0 elsewhere."""
    metrics: dict[str, float]
    """rollout_is/{mean, max_raw, truncated_frac} over response tokens."""


def truncated_importance_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, threshold: float
) -> ImportanceWeights:
    """Weights that turn a policy-gradient estimate from samples of the rollout policy into one for the policy
    whose log-probs are ``old_log_probs`` (the PPO ratio's centre), truncated at ``threshold`` to bound the
    variance (Ionides 2008; verl's ``rollout_is`` in token/truncate mode). No gradient flows through them."""
    mask = response_mask > 0
    log_ratio = torch.where(mask, old_log_probs.detach() - rollout_log_probs, 0.0)
    raw = log_ratio.exp()
    weights = torch.where(mask, raw.clamp(max=threshold), 0.0)
    tokens = mask.sum().clamp(min=1)
    metrics = {
        "rollout_is/mean": float(weights.sum() / tokens),
        "rollout_is/max_raw": float(torch.where(mask, raw, 0.0).max()),
        "rollout_is/truncated_frac": float((mask & (raw > threshold)).sum() / tokens),
    }
    return ImportanceWeights(weights, metrics)
