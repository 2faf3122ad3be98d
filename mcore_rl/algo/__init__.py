"""RL algorithms as pure tensor functions: advantages, policy/value losses, KL, loss aggregation, entropy.

Definitions follow verl's `verl/trainer/ppo/core_algos.py` so the same inputs give the same numbers (up to
floating point). Tensors are [B, T] over response tokens with a 0/1 mask of the same shape; nothing here is
distributed: global token/sequence counts come in as arguments (`LossAggregation`).

    rewards --(apply_kl_penalty)--> rewards --(compute_*_advantages)--> advantages
    log_probs_from_logits --> ppo_policy_loss / gspo_policy_loss (+ kl_loss, - entropy) --> aggregate_loss
    sequence_log_probs (policy, reference) --> dpo_loss (sigmoid / cDPO, robust, hinge, ipo)

The package loads a module on first use of one of its names (PEP 562), so that ``mcore_rl.algo.settings``,
which the run config reads, comes without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_rl.algo.advantages import (
        AdvantageOutput,
        compute_advantages,
        compute_gae_advantages,
        compute_grpo_advantages,
        compute_reinforce_pp_advantages,
        compute_reinforce_pp_baseline_advantages,
        compute_remax_advantages,
        compute_rloo_advantages,
        outcome_rewards,
    )
    from mcore_rl.algo.dpo import DPOOutput, DPOSettings, dpo_loss, sequence_log_probs
    from mcore_rl.algo.kl import (
        AdaptiveKLController,
        FixedKLController,
        KLRewardOutput,
        apply_kl_penalty,
        kl_loss,
        kl_penalty,
    )
    from mcore_rl.algo.logits import (
        entropy_from_logits,
        log_probs_and_entropy_from_logits,
        log_probs_from_logits,
    )
    from mcore_rl.algo.losses import (
        LossAggregation,
        PolicyLossOutput,
        ValueLossOutput,
        aggregate_loss,
        gspo_policy_loss,
        num_valid_seqs,
        ppo_policy_loss,
        value_loss,
    )
    from mcore_rl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
    from mcore_rl.algo.settings import AdvEstimator, DPOLossType, KLEstimator, LossAggMode, parse_kl_estimator

_HOMES = {
    "AdaptiveKLController": "mcore_rl.algo.kl",
    "AdvEstimator": "mcore_rl.algo.settings",
    "AdvantageOutput": "mcore_rl.algo.advantages",
    "DPOLossType": "mcore_rl.algo.settings",
    "DPOOutput": "mcore_rl.algo.dpo",
    "DPOSettings": "mcore_rl.algo.dpo",
    "FixedKLController": "mcore_rl.algo.kl",
    "KLEstimator": "mcore_rl.algo.settings",
    "KLRewardOutput": "mcore_rl.algo.kl",
    "LossAggMode": "mcore_rl.algo.settings",
    "LossAggregation": "mcore_rl.algo.losses",
    "PolicyLossOutput": "mcore_rl.algo.losses",
    "ValueLossOutput": "mcore_rl.algo.losses",
    "aggregate_loss": "mcore_rl.algo.losses",
    "apply_kl_penalty": "mcore_rl.algo.kl",
    "compute_advantages": "mcore_rl.algo.advantages",
    "compute_gae_advantages": "mcore_rl.algo.advantages",
    "compute_grpo_advantages": "mcore_rl.algo.advantages",
    "compute_reinforce_pp_advantages": "mcore_rl.algo.advantages",
    "compute_reinforce_pp_baseline_advantages": "mcore_rl.algo.advantages",
    "compute_remax_advantages": "mcore_rl.algo.advantages",
    "compute_rloo_advantages": "mcore_rl.algo.advantages",
    "dpo_loss": "mcore_rl.algo.dpo",
    "entropy_from_logits": "mcore_rl.algo.logits",
    "gspo_policy_loss": "mcore_rl.algo.losses",
    "kl_loss": "mcore_rl.algo.kl",
    "kl_penalty": "mcore_rl.algo.kl",
    "log_probs_and_entropy_from_logits": "mcore_rl.algo.logits",
    "log_probs_from_logits": "mcore_rl.algo.logits",
    "masked_mean": "mcore_rl.algo.masked",
    "masked_sum": "mcore_rl.algo.masked",
    "masked_var": "mcore_rl.algo.masked",
    "masked_whiten": "mcore_rl.algo.masked",
    "num_valid_seqs": "mcore_rl.algo.losses",
    "outcome_rewards": "mcore_rl.algo.advantages",
    "parse_kl_estimator": "mcore_rl.algo.settings",
    "ppo_policy_loss": "mcore_rl.algo.losses",
    "sequence_log_probs": "mcore_rl.algo.dpo",
    "value_loss": "mcore_rl.algo.losses",
}
"""Where each public name lives."""

__all__ = [
    "AdaptiveKLController",
    "AdvEstimator",
    "AdvantageOutput",
    "DPOLossType",
    "DPOOutput",
    "DPOSettings",
    "FixedKLController",
    "KLEstimator",
    "KLRewardOutput",
    "LossAggMode",
    "LossAggregation",
    "PolicyLossOutput",
    "ValueLossOutput",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "num_valid_seqs",
    "outcome_rewards",
    "parse_kl_estimator",
    "ppo_policy_loss",
    "sequence_log_probs",
    "value_loss",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
