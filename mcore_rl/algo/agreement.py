"""How far the rollout engine's policy is from the trainer's: NeMo-RL's ``token_mult_prob_error`` (the standing
health check of every step) and the truncated importance weights that correct a lagged rollout (TIS).

Both take [N, S] position-aligned log-probs and a response mask (:mod:`mcore_rl.types`); pure and tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
