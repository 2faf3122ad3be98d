"""RL algorithms as pure tensor functions: advantages, policy/value losses, KL, loss aggregation, entropy.

Definitions follow verl's `verl/trainer/ppo/core_algos.py` so the same inputs give the same numbers (up to
floating point). Tensors are [B, T] over response tokens with a 0/1 mask of the same shape; nothing here is
distributed: global token/sequence counts come in as arguments (`LossAggregation`).

    rewards --(apply_kl_penalty)--> rewards --(compute_*_advantages)--> advantages
    log_probs_from_logits --> ppo_policy_loss / gspo_policy_loss (+ kl_loss, - entropy) --> aggregate_loss
    sequence_log_probs (policy, reference) --> dpo_loss (sigmoid / cDPO, robust, hinge, ipo)
"""

from mcore_rl.algo.advantages import (
    AdvantageOutput,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from mcore_rl.algo.dpo import DPOLossType, DPOOutput, DPOSettings, dpo_loss, sequence_log_probs
from mcore_rl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    KLRewardOutput,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    parse_kl_estimator,
)
from mcore_rl.algo.logits import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits
from mcore_rl.algo.losses import (
    LossAggMode,
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

__all__ = [
    "AdaptiveKLController",
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
    "parse_kl_estimator",
    "ppo_policy_loss",
    "sequence_log_probs",
    "value_loss",
]
