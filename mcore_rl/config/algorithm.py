"""Schema section ``algorithm``: the advantage estimator and the PPO-style actor loss (verl's ``algorithm`` plus
its actor loss keys); the choice lists live with the algorithms (:mod:`mcore_rl.algo.settings`).

A plain dataclass with a docstring per field, checked when constructed (:func:`mcore_rl.io.fields.check_section`),
as the sections of :mod:`mcore_rl.config.model` are. Nothing here imports megatron or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from omegaconf import II

from mcore_rl.algo.settings import (
    ADV_ESTIMATOR_ALIASES,
    GSPO_CLIP,
    AdvEstimator,
    FilterGroups,
    KLControl,
    LossAggMode,
    PolicyLossMode,
    kl_estimator_rule,
)
from mcore_rl.io.fields import (
    CLOSED_UNIT,
    NON_NEGATIVE,
    OPTIONAL_POSITIVE,
    POSITIVE,
    FieldError,
    Rule,
    check_section,
    choice,
)


class RecomputeOldLogProbs(str, Enum):
    """``algorithm.recompute_old_log_probs``: when the actor's old-log-prob pass runs before the update."""

    AUTO = "auto"
    """Skipped where it provably equals the update's own forward (verl's on-policy shortcut)."""
    ALWAYS = "always"


@dataclass
class AlgorithmConfig:
    """Advantage estimator and the PPO-style actor loss (verl's ``algorithm`` plus its actor loss keys)."""

    SECTION: ClassVar[str] = "algorithm"

    adv_estimator: str = AdvEstimator.GRPO.value
    """grpo, dr_grpo (GRPO without std normalisation, seq-mean-token-sum-norm loss), rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline, gae (PPO with the ``critic``); 'reinforce++' and
    'reinforce++-baseline' are accepted spellings."""
    norm_adv_by_std_in_grpo: bool | None = None
    """GRPO: divide by the group's reward std. null: true, and false for dr_grpo (which refuses true)."""
    gamma: float = 1.0
    """Discount of the REINFORCE++ return."""
    lam: float = 1.0
    """GAE lambda (``adv_estimator=gae``; the critic-free estimators ignore it)."""
    use_kl_loss: bool = False
    """Add KL(actor || reference) to the loss; needs reference log-probs."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), each optionally with '+' (straight-through)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token rewards instead (verl's in-reward KL)."""
    kl_penalty: str = "kl"
    """Estimator of the in-reward KL (same names as ``kl_loss_type``)."""
    kl_ctrl: KLControl = field(default_factory=KLControl)
    """Coefficient of the in-reward KL."""
    policy_loss: str = PolicyLossMode.VANILLA.value
    """The policy-gradient loss (verl's ``actor.policy_loss.loss_mode``): vanilla (PPO's clipped token ratio)
    or gspo (GSPO: the clip on each sequence's length-normalised ratio, aggregated seq-mean-token-mean; the
    KL and entropy terms keep ``loss_agg_mode``)."""
    clip_ratio_low: float | None = None
    """Ratio clip below 1: ratio >= 1 - clip_ratio_low. null: 0.2, and 3e-4 with ``policy_loss=gspo``."""
    clip_ratio_high: float | None = None
    """Ratio clip above 1 (DAPO's clip-higher when larger than ``clip_ratio_low``). null: 0.2, and 4e-4 with
    ``policy_loss=gspo``."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: str | None = None
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm. null:
    token-mean, and seq-mean-token-sum-norm for dr_grpo (which refuses any other)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 disables)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    ppo_mini_batch_size: int = II("data.train_batch_size")
    """Prompts per optimizer step (each brings ``rollout.n`` responses); follows the train batch size,
    which makes the update on-policy."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per forward/backward on one data-parallel rank (gradient accumulation over the rest)."""
    ppo_max_token_len_per_gpu: int | None = None
    """Token budget of an actor update micro-batch (rows x longest row) instead of
    ``ppo_micro_batch_size_per_gpu`` rows; each mini-batch's rows are also balanced over the data-parallel
    ranks by tokens and each micro-batch is trimmed to its longest row (``engine/packing/token_batching.py``).
    Needs pipeline_model_parallel_size=1; null: a fixed number of rows."""
    recompute_old_log_probs: str = RecomputeOldLogProbs.AUTO.value
    """The actor's forward pass for the PPO ratio's old log-probs before the update. auto (verl's on-policy
    shortcut): skipped when the update is one optimizer step (``ppo_epochs=1``, ``ppo_mini_batch_size =
    data.train_batch_size``) on a rollout of the current weights (not a ``trainer.one_step_off`` lagged
    one) and nothing else reads them first (not ``use_kl_in_reward``; the PPO step always keeps the pass):
    the old log-probs are then the update's own forward log-probs, detached (ratio 1), and
    ``token_mult_prob_error`` is taken from that forward. always: run the pass every step (same numbers,
    one actor forward more per step)."""
    filter_groups: FilterGroups = field(default_factory=FilterGroups)
    """DAPO's dynamic sampling: keep only prompt groups whose responses' rewards differ, sampling more prompts
    until ``data.train_batch_size`` such groups fill the step (critic-free estimators, on-policy)."""
    rollout_is_threshold: float | None = 2.0
    """Truncated importance sampling of lagged rollouts (``trainer.one_step_off``, policy lag 1): each response
    token's policy loss is weighted by ``min(pi_old / pi_rollout, rollout_is_threshold)`` (detached), where
    pi_old is the recomputed old log-prob of the actor being updated and pi_rollout the log-prob of the
    weights that sampled it: the samples come from the policy one update before the one PPO's ratio is
    centred on (decoupled PPO; verl's ``rollout_is``, TIS). Logged as ``rollout_is/*``. null: no correction.
    On-policy rollouts (lag 0) are never weighted."""

    def __post_init__(self) -> None:
        # Store one spelling so the driver compares against one name.
        if isinstance(self.adv_estimator, str):
            self.adv_estimator = ADV_ESTIMATOR_ALIASES.get(self.adv_estimator, self.adv_estimator)
        self._follow_the_estimator()
        check_section(
            self,
            {
                "adv_estimator": choice(AdvEstimator),
                "gamma": CLOSED_UNIT,
                "lam": CLOSED_UNIT,
                "kl_loss_coef": NON_NEGATIVE,
                "kl_loss_type": kl_estimator_rule(),
                "kl_penalty": kl_estimator_rule(),
                "policy_loss": choice(PolicyLossMode),
                "clip_ratio_low": Rule("in [0, 1) or null", lambda v: v is None or 0 <= v < 1),
                "clip_ratio_high": Rule(">= 0 or null", lambda v: v is None or v >= 0),
                "clip_ratio_c": Rule("> 1", lambda v: v > 1),
                "loss_agg_mode": choice(LossAggMode, optional=True),
                "ppo_epochs": POSITIVE,
                "ppo_mini_batch_size": POSITIVE,
                "ppo_micro_batch_size_per_gpu": POSITIVE,
                "ppo_max_token_len_per_gpu": OPTIONAL_POSITIVE,
                "recompute_old_log_probs": choice(RecomputeOldLogProbs),
                "rollout_is_threshold": Rule("> 1 or null", lambda v: v is None or v > 1),
            },
        )

    @property
    def aggregation(self) -> str:
        """The loss aggregation the run uses: ``loss_agg_mode``, or the estimator's when null."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        dr_grpo = self.adv_estimator == AdvEstimator.DR_GRPO
        return (LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM if dr_grpo else LossAggMode.TOKEN_MEAN).value

    @property
    def clip_range(self) -> tuple[float, float]:
        """(below, above) 1: ``clip_ratio_low`` / ``clip_ratio_high``, or the loss's own where null."""
        gspo = self.policy_loss == PolicyLossMode.GSPO
        low, high = GSPO_CLIP if gspo else (0.2, 0.2)
        return (
            low if self.clip_ratio_low is None else self.clip_ratio_low,
            high if self.clip_ratio_high is None else self.clip_ratio_high,
        )

    @property
    def norm_by_std(self) -> bool:
        """Whether GRPO divides by the group's std: ``norm_adv_by_std_in_grpo``, or the estimator's."""
        if self.norm_adv_by_std_in_grpo is not None:
            return self.norm_adv_by_std_in_grpo
        return self.adv_estimator != AdvEstimator.DR_GRPO

    def _follow_the_estimator(self) -> None:
        """Dr.GRPO is GRPO with the std normalisation off and the seq-mean-token-sum-norm loss: the two keys
        follow it when null, and a contradicting value is refused rather than silently replaced."""
        if self.adv_estimator != AdvEstimator.DR_GRPO:
            return
        norm_sum = LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM.value
        if self.loss_agg_mode not in (None, norm_sum):
            raise FieldError(
                [
                    (
                        "algorithm.loss_agg_mode",
                        f"={self.loss_agg_mode}: dr_grpo aggregates by {norm_sum} (or null)",
                    )
                ]
            )
        if self.norm_adv_by_std_in_grpo:
            raise FieldError(
                [
                    (
                        "algorithm.norm_adv_by_std_in_grpo",
                        "=true: dr_grpo does not divide by the std (false or null)",
                    )
                ]
            )
