"""Policy and value losses, and the aggregation of a [B, T] loss matrix into a scalar.

Matches verl's `agg_loss`, `compute_policy_loss_vanilla`, `compute_policy_loss_gspo` and `compute_value_loss`
(`verl/trainer/ppo/core_algos.py`) up to floating point. All [B, T] inputs cover response tokens only; masked-out
positions are replaced with 0 before any arithmetic, so NaN/inf there reaches neither the loss nor its gradient.

Split invariance. Pass the *global* counts of the batch that one optimizer step averages over
(`LossAggregation.global_num_tokens` / `global_num_seqs`, e.g. summed over the micro-batches of every DP rank);
then the loss of each shard is its share, and summing the shard losses over any DP x micro-batch split equals the
full-batch loss. Two scale factors are the engine's business, not ours: DP gradient averaging (multiply the loss
by `dp_size` when gradients are averaged across DP ranks, as verl does) and Megatron's pipeline schedule, which
divides each micro-batch loss by `num_microbatches` unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algo.masked import check_mask, check_shape, masked_mean, parse_enum, zero_masked
from mcore_rl.algo.settings import LossAggMode

# verl clamps the per-token log-ratio to [-20, 20] before exp() so that exp never overflows in float32.
_LOG_RATIO_CLAMP = 20.0
# GSPO clamps the sequence log-ratio from above only (verl uses 10).
_GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class LossAggregation:
    """The aggregation mode plus the global counts that make it invariant to DP / micro-batch splits."""

    mode: LossAggMode | str = LossAggMode.TOKEN_MEAN
    """One of `LossAggMode` (its value string is accepted)."""
    global_num_tokens: float | torch.Tensor | None = None
    """Valid tokens in the whole global batch (token-mean). None: the local mask's count."""
    global_num_seqs: float | torch.Tensor | None = None
    """Sequences with at least one valid token in the whole global batch (seq-mean modes). None: local count."""
    norm_constant: float | None = None
    """Divisor of seq-mean-token-sum-norm; keep it fixed over training (the max response length). None: T."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_enum(LossAggMode, self.mode, "loss_agg_mode"))
        for name in ("global_num_tokens", "global_num_seqs", "norm_constant"):
            value = getattr(self, name)
            if isinstance(value, int | float) and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def aggregate(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`aggregate_loss(loss_mat, mask, ...)` with this mode and these counts."""
        return aggregate_loss(
            loss_mat,
            mask,
            self.mode,
            global_num_tokens=self.global_num_tokens,
            global_num_seqs=self.global_num_seqs,
            norm_constant=self.norm_constant,
        )


def num_valid_seqs(mask: torch.Tensor) -> torch.Tensor:
    """Number of sequences (rows of a [B, T] mask) with at least one valid token: the seq-mean denominator."""
    return (check_mask(mask).sum(dim=-1) > 0).sum()


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode | str = LossAggMode.TOKEN_MEAN,
    *,
    global_num_tokens: float | torch.Tensor | None = None,
    global_num_seqs: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss into a scalar (verl's `agg_loss`).

    * token-mean: `sum(loss over valid tokens) / num_tokens`
    * token-sum: `sum(loss over valid tokens)` (additive over DP ranks and micro-batches: no count needed)
    * seq-mean-token-sum: `sum_i (sum_t loss_it) / num_seqs`
    * seq-mean-token-mean: `sum_i (mean_t loss_it) / num_seqs`
    * seq-mean-token-sum-norm: `sum_i (sum_t loss_it) / num_seqs / norm_constant` (norm_constant default T)

    `num_tokens` / `num_seqs` are the global counts when given, else the local ones. A sequence counts only if
    it has a valid token (verl's rule): fully masked rows, e.g. padding rows of a micro-batch, add nothing to the
    numerator or the denominator. An empty local batch gives 0 (verl would divide 0 by 0). Computed in float32.
    """
    spec = LossAggregation(mode, global_num_tokens, global_num_seqs, norm_constant)
    mask = check_mask(mask)
    check_shape("loss_mat", loss_mat, mask.shape)
    values = zero_masked(loss_mat, mask)
    if spec.mode == LossAggMode.TOKEN_MEAN:
        return _safe_div(values.sum(), spec.global_num_tokens, mask.sum())
    if spec.mode == LossAggMode.TOKEN_SUM:
        return values.sum()

    tokens_per_seq = mask.sum(dim=-1)
    seq_losses = values.sum(dim=-1)
    if spec.mode == LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        seq_losses = seq_losses / tokens_per_seq.clamp(min=1)
    loss = _safe_div(seq_losses.sum(), spec.global_num_seqs, (tokens_per_seq > 0).sum())
    if spec.mode == LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        loss = loss / (spec.norm_constant if spec.norm_constant is not None else mask.shape[-1])
    return loss


def _safe_div(
    total: torch.Tensor, global_count: float | torch.Tensor | None, local_count: torch.Tensor
) -> torch.Tensor:
    """`total / count` with the global count if given, else the local one; 0 when the local count is 0."""
    if global_count is not None:
        return total / global_count
    count = local_count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


@dataclass(frozen=True)
class PolicyLossOutput:
    """Policy loss and its diagnostics (verl's `pg_loss`, `pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`)."""

    loss: torch.Tensor
    """Scalar loss to backpropagate (carries the gradient)."""
    clip_frac: torch.Tensor
    """Scalar, detached: fraction of valid tokens where the clipped term was the active one."""
    clip_frac_lower: torch.Tensor
    """Scalar, detached: fraction of valid tokens with A < 0 capped by the dual clip (-A * clip_ratio_c)."""
    approx_kl: torch.Tensor
    """Scalar, detached: mean over valid tokens of `old_log_prob - log_prob` (k1 estimate of KL(old || new))."""


def _check_policy_inputs(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate shapes; return the bool mask and the inputs with masked-out positions zeroed (float32)."""
    mask = check_mask(mask)
    check_shape("log_probs", log_probs, mask.shape)
    check_shape("old_log_probs", old_log_probs, mask.shape)
    check_shape("advantages", advantages, mask.shape)
    weights = None
    if importance_weights is not None:
        check_shape("importance_weights", importance_weights, mask.shape)
        weights = zero_masked(importance_weights, mask)
    return (
        mask,
        zero_masked(log_probs, mask),
        zero_masked(old_log_probs, mask),
        zero_masked(advantages, mask),
        weights,
    )


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    importance_weights: torch.Tensor | None = None,
    agg: LossAggregation | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and dual-clip, verl's `compute_policy_loss_vanilla`.

    Per token: `ratio = exp(clamp(logp - logp_old, -20, 20))`;
    `l = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))` (DAPO's clip-higher when
    low != high; both default to `clip_ratio`); for A < 0 the dual clip (Ye et al. 2020) caps the loss at
    `-A * clip_ratio_c`: `l = min(l, -A * clip_ratio_c)`. Optional `importance_weights` (e.g. truncated
    rollout-correction weights, treated as constants by the caller) multiply `l` before aggregation.

    Shapes: log_probs, old_log_probs, advantages, mask, importance_weights [B, T] -> scalars.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if not 0.0 <= low < 1.0 or high < 0.0:
        raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got low={low}, high={high}")
    mask, logp, old_logp, adv, weights = _check_policy_inputs(
        log_probs, old_log_probs, advantages, mask, importance_weights
    )

    log_ratio = torch.clamp(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_max = torch.maximum(unclipped, clipped)
    dual = -adv * clip_ratio_c
    losses = torch.where(adv < 0, torch.minimum(dual, clip_max), clip_max)
    if weights is not None:
        losses = losses * weights

    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).to(logp.dtype), mask)
        clip_frac_lower = masked_mean(((clip_max > dual) & (adv < 0)).to(logp.dtype), mask)
        approx_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(
        loss=(agg or LossAggregation()).aggregate(losses, mask),
        clip_frac=clip_frac,
        clip_frac_lower=clip_frac_lower,
        approx_kl=approx_kl,
    )


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    importance_weights: torch.Tensor | None = None,
    global_num_seqs: float | torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level ratio, verl's `compute_policy_loss_gspo`.

    `s_i = exp(mean over valid t of (logp - logp_old))` is the length-normalised sequence ratio. Each token uses
    `s_it = sg(s_i) * p_t / sg(p_t)` (value s_i, gradient that of the token's own log-prob), log clamped at 10;
    `l = max(-A * s_it, -A * clip(s_it, 1 - low, 1 + high))`. Aggregated with seq-mean-token-mean, as GSPO
    prescribes; defaults are the paper's clip ranges. clip_frac_lower is always 0 (no dual clip).

    Shapes: log_probs, old_log_probs, advantages, mask, importance_weights [B, T] -> scalars.
    """
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ValueError(f"clip ranges must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    mask, logp, old_logp, adv, weights = _check_policy_inputs(
        log_probs, old_log_probs, advantages, mask, importance_weights
    )
    log_ratio = logp - old_logp
    seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -adv * seq_ratio
    clipped = -adv * torch.clamp(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    if weights is not None:
        losses = losses * weights

    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).to(logp.dtype), mask)
        approx_kl = masked_mean(-log_ratio, mask)
    loss = aggregate_loss(losses, mask, LossAggMode.SEQ_MEAN_TOKEN_MEAN, global_num_seqs=global_num_seqs)
    return PolicyLossOutput(
        loss=loss, clip_frac=clip_frac, clip_frac_lower=torch.zeros_like(clip_frac), approx_kl=approx_kl
    )


@dataclass(frozen=True)
class ValueLossOutput:
    """Critic loss and its diagnostic (verl's `vf_loss`, `vf_clipfrac`)."""

    loss: torch.Tensor
    """Scalar loss to backpropagate."""
    clip_frac: torch.Tensor
    """Scalar, detached: fraction of valid tokens where the clipped error was the larger one."""


def value_loss(
    values_pred: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range_value: float = 0.5,
    agg: LossAggregation | None = None,
) -> ValueLossOutput:
    """Clipped value loss, verl's `compute_value_loss`.

    `v_clip = clip(v, v_old - eps, v_old + eps)`; per token `max((v - R)^2, (v_clip - R)^2)`; the loss is
    `0.5 * aggregate(...)`.

    Shapes: values_pred (current critic output), values_old (critic output at rollout), returns, mask [B, T].
    """
    if clip_range_value < 0.0:
        raise ValueError(f"clip_range_value must be >= 0, got {clip_range_value}")
    mask = check_mask(mask)
    check_shape("values_pred", values_pred, mask.shape)
    check_shape("values_old", values_old, mask.shape)
    check_shape("returns", returns, mask.shape)
    v, v_old, ret = (zero_masked(x, mask) for x in (values_pred, values_old, returns))
    v_clipped = torch.maximum(torch.minimum(v, v_old + clip_range_value), v_old - clip_range_value)
    err_unclipped = (v - ret).square()
    err_clipped = (v_clipped - ret).square()
    loss = 0.5 * (agg or LossAggregation()).aggregate(torch.maximum(err_unclipped, err_clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean((err_clipped > err_unclipped).to(v.dtype), mask)
    return ValueLossOutput(loss=loss, clip_frac=clip_frac)
