"""Direct preference optimisation losses as pure functions of per-sequence log-probs.

Definitions follow TRL's ``DPOTrainer`` (``trl/trainer/dpo_trainer.py``; see shared/notes/peer-integration.md
§6), with the two options TRL 0.28 dropped kept explicit, because users carry recipes that use them:
conservative DPO (``label_smoothing`` on the sigmoid loss) and reference-free DPO.

Inputs are per pair ``[B]``: the *summed* log-prob of the chosen and rejected completions under the policy and
under the reference, and the completion lengths (tokens). With ``logratio = logp - ref_logp`` and
``Δ = logratio_chosen - logratio_rejected``::

    sigmoid  -(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)           (ε = label_smoothing; ε > 0 is cDPO, Mitchell 2023)
    robust   [-(1-ε)·logσ(βΔ) + ε·logσ(-βΔ)] / (1-2ε)   (rDPO, Chowdhury et al. 2024; ε = label flip rate)
    hinge    relu(1 - βΔ)                               (SLiC)
    ipo      (Δ_avg - 1/(2β))²                          (Δ from per-token *averaged* log-probs, as TRL does
                                                          after confirming it with the IPO authors)

``reference_free`` sets every reference log-prob to 0. The implicit rewards TRL logs are
``β·logratio`` (for IPO, of the length-averaged log-probs, the quantity its loss sees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_rl.algo.settings import DPOLossType


@dataclass(frozen=True)
class DPOSettings:
    """How a preference pair is scored."""

    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference (TRL's default 0.1)."""
    loss_type: DPOLossType | str = DPOLossType.SIGMOID
    """sigmoid, robust, hinge or ipo (see the module docstring)."""
    label_smoothing: float = 0.0
    """ε: the assumed probability that a pair's labels are flipped (sigmoid: cDPO; robust: rDPO). Must be in
    [0, 0.5); hinge and ipo refuse a non-zero value rather than ignore it."""
    reference_free: bool = False
    """Score against a uniform reference (every reference log-prob 0)."""

    def __post_init__(self) -> None:
        loss_type = DPOLossType(self.loss_type)  # ValueError naming the bad value
        object.__setattr__(self, "loss_type", loss_type)
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and loss_type in (DPOLossType.HINGE, DPOLossType.IPO):
            raise ValueError(f"label_smoothing applies to sigmoid and robust only, not {loss_type.value}")


@dataclass(frozen=True)
class DPOOutput:
    """Per-pair results; the caller aggregates (a mean over the global number of pairs)."""

    losses: torch.Tensor  # [B] differentiable
    chosen_rewards: torch.Tensor  # [B] detached: β·(logp_c - ref_logp_c)
    rejected_rewards: torch.Tensor  # [B] detached: β·(logp_r - ref_logp_r)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    settings: DPOSettings,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> DPOOutput:
    """Per-pair DPO losses [B] and implicit rewards from summed log-probs [B] (lengths [B]: IPO only)."""
    shape = chosen_logps.shape
    for name, value in (
        ("rejected_logps", rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        if value.shape != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, chosen_logps {tuple(shape)}")
    if settings.reference_free:
        ref_chosen_logps = torch.zeros_like(ref_chosen_logps)
        ref_rejected_logps = torch.zeros_like(ref_rejected_logps)
    if settings.loss_type is DPOLossType.IPO:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                "the ipo loss averages log-probs per token: pass chosen_lengths and rejected_lengths"
            )
        # Policy and reference are averaged over the same tokens, as TRL averages both before the ratio.
        c_len, r_len = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        chosen_logps, ref_chosen_logps = chosen_logps / c_len, ref_chosen_logps / c_len
        rejected_logps, ref_rejected_logps = rejected_logps / r_len, ref_rejected_logps / r_len
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    losses = _pair_losses(chosen_ratio - rejected_ratio, settings)
    beta = settings.beta
    return DPOOutput(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def _pair_losses(delta: torch.Tensor, settings: DPOSettings) -> torch.Tensor:
    beta, eps = settings.beta, settings.label_smoothing
    if settings.loss_type is DPOLossType.SIGMOID:
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    if settings.loss_type is DPOLossType.ROBUST:
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if settings.loss_type is DPOLossType.HINGE:
        return torch.relu(1 - beta * delta)
    return (delta - 1 / (2 * beta)) ** 2  # IPO, on the length-averaged Δ


def sequence_log_probs(
    token_log_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] summed log-prob over the masked tokens, [B] their count) from [B, T] token log-probs and mask.

    Positions off the mask are zeroed with ``where`` (not a product), so padding that holds NaN/inf cannot leak
    into the sum or its gradient."""
    kept = torch.where(mask.bool(), token_log_probs, torch.zeros_like(token_log_probs))
    return kept.sum(dim=-1), mask.sum(dim=-1).to(token_log_probs.dtype)
