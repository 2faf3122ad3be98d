"""KL in the reward (``algorithm.use_kl_in_reward``): ``r_t = score_t - beta * KL_t(actor_old || ref)``.

The coefficient ``beta`` comes from a controller (``algorithm.kl_ctrl``): fixed, or the adaptive one of
Ziegler et al. that steers the measured KL to ``target_kl``. The controller is driver state: it is saved in
the run checkpoint (``state_dict``) so that a resumed run penalises with the coefficient the uninterrupted
one would have used. Beside it, the KL-loss mode (``algorithm.use_kl_loss``, GRPO's) stays in the actor loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.algo.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty
from mcore_rl.algo.settings import KLControl, KLControlType


class KLRewardController:
    """The in-reward KL coefficient with its update rule and checkpointable state."""

    def __init__(self, ctrl: KLControl) -> None:
        self.type = ctrl.type
        self.impl: FixedKLController | AdaptiveKLController
        if KLControlType(ctrl.type) is KLControlType.ADAPTIVE:
            self.impl = AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
        else:
            self.impl = FixedKLController(ctrl.kl_coef)

    @property
    def value(self) -> float:
        return float(self.impl.value)

    def update(self, current_kl: float, n_steps: int) -> None:
        self.impl.update(current_kl, n_steps)

    def state_dict(self) -> dict[str, Any]:
        # repr-exact: JSON keeps a float's shortest round-trip repr, so the coefficient comes back bit-equal.
        return {"type": self.type, "kl_coef": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != self.type:
            raise ValueError(
                f"algorithm.kl_ctrl.type={self.type!r} but the checkpoint's controller is {state.get('type')!r}"
            )
        self.impl.value = float(state["kl_coef"])


@dataclass(frozen=True)
class KLRewards:
    """Token rewards after the in-reward KL penalty, and what the step logs about it."""

    rewards: torch.Tensor
    """[N, S] float32: ``scores - beta * KL`` on the response positions, 0 elsewhere."""
    kl_coef: float
    """The coefficient used this step (before the controller's update)."""
    mean_kl: float
    """Per-sequence token-mean KL, averaged over sequences (what the controller sees)."""


def penalise(
    token_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    controller: KLRewardController,
    estimator: str,
) -> KLRewards:
    """Apply the penalty with the controller's current coefficient, then update the controller (verl's order:
    the step's KL, over its ``N`` sequences, moves the next step's coefficient)."""
    beta = controller.value
    out = apply_kl_penalty(
        token_scores, old_log_probs, ref_log_probs, mask > 0, kl_coef=beta, estimator=estimator
    )
    controller.update(out.mean_kl, n_steps=int(mask.shape[0]))
    return KLRewards(out.rewards.float(), beta, out.mean_kl)
