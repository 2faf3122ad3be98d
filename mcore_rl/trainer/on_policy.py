"""The on-policy shortcut (``algorithm.recompute_old_log_probs=auto``): when the update's own forward can stand
for the old log-probs of a critic-free step, so that the separate old-log-prob pass is skipped, and the line
the run logs once saying which applies and why."""

from __future__ import annotations

from mcore_rl.config import AlgorithmConfig
from mcore_rl.config.algorithm import RecomputeOldLogProbs
from mcore_rl.config.model import ModelConfig
from mcore_rl.trainer.groups.actor import UpdatePlan


def recompute_old_log_probs(
    algo: AlgorithmConfig, plan: UpdatePlan, policy_lag: int, dropout: float = 0.0
) -> bool:
    """Whether the step runs the actor's old-log-prob pass (``algorithm.recompute_old_log_probs``). auto
    skips it only where it provably equals the update's own forward: one optimizer step (one epoch, one
    mini-batch) on a rollout of the weights being updated (policy lag 0), no in-reward KL reading the
    actor's log-probs before the update, and no ``dropout`` in the update's forward (LoRA's)."""
    try:
        mode = RecomputeOldLogProbs(algo.recompute_old_log_probs)
    except ValueError:
        raise ValueError(
            f"algorithm.recompute_old_log_probs={algo.recompute_old_log_probs!r}: choose auto or always"
        ) from None
    return (
        mode is RecomputeOldLogProbs.ALWAYS or _off_policy_reason(algo, plan, policy_lag, dropout) is not None
    )


def training_dropout(model: ModelConfig) -> float:
    """Dropout in the update's forward: LoRA's on the adapters' inputs (the base model has none)."""
    return model.lora_dropout if model.lora_rank else 0.0


def _off_policy_reason(
    algo: AlgorithmConfig, plan: UpdatePlan, policy_lag: int, dropout: float = 0.0
) -> str | None:
    """Why the update's own forward cannot stand for the old log-probs, or None where it can."""
    if plan.ppo_epochs != 1 or plan.num_mini_batches != 1:
        return (
            f"{plan.ppo_epochs} epoch(s) x {plan.num_mini_batches} mini-batches: the optimizer steps more than once "
            "(algorithm.ppo_epochs, algorithm.ppo_mini_batch_size)"
        )
    if policy_lag:
        return f"the rollout is {policy_lag} update(s) behind the weights (trainer.one_step_off)"
    if algo.use_kl_in_reward:
        return "algorithm.use_kl_in_reward reads the actor's log-probs before the update"
    if dropout:
        # the update's forward drops adapter inputs; the old log-probs are the policy's without dropout
        return f"model.lora_dropout={dropout}: the update's forward is not the policy that sampled"
    return None


def old_log_prob_line(algo: AlgorithmConfig, plan: UpdatePlan, policy_lag: int, dropout: float = 0.0) -> str:
    """Whether the old-log-prob pass of a critic-free step runs and why (logged once per run)."""
    if algo.recompute_old_log_probs == RecomputeOldLogProbs.ALWAYS:
        return "algorithm.recompute_old_log_probs=always: the old-log-prob pass runs every step"
    reason = _off_policy_reason(algo, plan, policy_lag, dropout)
    if reason is None:
        return (
            "algorithm.recompute_old_log_probs=auto (the old-log-prob pass skipped: one optimizer step on the "
            "rollout's own weights, whose forward gives them)"
        )
    return f"algorithm.recompute_old_log_probs=auto (the old-log-prob pass runs: {reason})"
