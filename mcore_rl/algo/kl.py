"""KL estimators between the policy and a reference policy, and the two ways of using them.

Estimators (Schulman, "Approximating KL divergence", 2020), per token from sampled log-probs, matching verl's
`kl_penalty` (`verl/trainer/ppo/core_algos.py`); `d = logp - logp_ref`:

* `k1` (alias `kl`): `d`.   * `abs`: `|d|`.   * `k2` (alias `mse`): `0.5 * d^2`.
* `k3` (alias `low_var_kl`): `exp(-d) + d - 1` with `-d` clamped to [-20, 20] and the result to [-10, 10].
* a `+` suffix (`k1+`, `k3+`, ...): straight-through: the forward value of the base estimator with the gradient
  of k2, whose expected gradient is the gradient of KL (those of k1 and k3 are not).

Placement: in the reward (PPO; `apply_kl_penalty` with a `FixedKLController` or `AdaptiveKLController`), or as a
loss term (GRPO; `kl_loss`, added to the policy loss times a coefficient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algo.losses import LossAggregation
from mcore_rl.algo.masked import check_mask, check_shape, masked_mean, zero_masked
from mcore_rl.algo.settings import KLEstimator, parse_kl_estimator

_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def _forward_kl(log_ratio: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    if estimator == KLEstimator.K1:
        return log_ratio
    if estimator == KLEstimator.ABS:
        return log_ratio.abs()
    if estimator == KLEstimator.K2:
        return 0.5 * log_ratio.square()
    # k3 = r - log r - 1 with r = p_ref / p: non-negative, unbiased, low variance. The clamps keep exp() finite.
    neg = torch.clamp(-log_ratio, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(neg) - neg - 1.0, -_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str | KLEstimator
) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (see the module docstring).

    Shapes: log_probs, ref_log_probs, mask [B, T] -> [B, T] float32, exactly 0 at masked-out positions.
    """
    base, straight_through = parse_kl_estimator(estimator)
    mask = check_mask(mask)
    check_shape("log_probs", log_probs, mask.shape)
    check_shape("ref_log_probs", ref_log_probs, mask.shape)
    log_ratio = zero_masked(log_probs, mask) - zero_masked(ref_log_probs, mask)
    value = _forward_kl(log_ratio, base)
    if straight_through and base != KLEstimator.K2:
        surrogate = 0.5 * log_ratio.square()
        value = surrogate - surrogate.detach() + value.detach()
    return value


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str | KLEstimator = "low_var_kl",
    agg: LossAggregation | None = None,
) -> torch.Tensor:
    """KL as a loss term (GRPO's `use_kl_loss`): `aggregate(kl_penalty(...))`; scale it by `kl_loss_coef`.

    Shapes: log_probs, ref_log_probs, mask [B, T] -> scalar.
    """
    kl = kl_penalty(log_probs, ref_log_probs, mask, estimator)
    return (agg or LossAggregation()).aggregate(kl, mask)


@dataclass(frozen=True)
class KLRewardOutput:
    """Result of `apply_kl_penalty`."""

    rewards: torch.Tensor
    """[B, T] `scores - kl_coef * kl`, 0 at masked-out positions."""
    mean_kl: float
    """Batch KL: per-sequence token mean of the estimate, averaged over sequences (feeds the controller)."""


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str | KLEstimator = "kl",
) -> KLRewardOutput:
    """KL in the reward (PPO's `use_kl_in_reward`), verl's `apply_kl_penalty`: `r_t = score_t - beta * KL_t`.

    `log_probs` are the rollout policy's (verl's `old_log_probs`). Pass `kl_coef=controller.value`, then call
    `controller.update(out.mean_kl, n_steps=batch_size)` as verl does.

    Shapes: token_level_scores, log_probs, ref_log_probs, mask [B, T].
    """
    mask = check_mask(mask)
    check_shape("token_level_scores", token_level_scores, mask.shape)
    kl = kl_penalty(log_probs, ref_log_probs, mask, estimator)
    rewards = zero_masked(token_level_scores, mask) - kl_coef * kl
    mean_kl = masked_mean(kl, mask, dim=-1).mean()
    return KLRewardOutput(rewards=rewards, mean_kl=float(mean_kl))


class FixedKLController:
    """Constant KL coefficient (verl's `FixedKLController`)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers share one interface."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (verl's `AdaptiveKLController`).

    `value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon`: the coefficient grows while
    the measured KL is above target and shrinks while below, by at most 20% per `horizon` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust `value` after a batch of `n_steps` samples whose mean KL was `current_kl`."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
