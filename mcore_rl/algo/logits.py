"""Log-probabilities of target tokens and entropy, from plain (not vocab-parallel) logits.

Both are computed in float32 whatever the logits' dtype (bf16 logits are upcast; float64 stays float64), after
dividing by the sampling temperature, so that they describe the distribution the rollout engine sampled from.

Entropy is `-sum_v p_v log p_v` with `log p = log_softmax(z)`. The textbook rewrite
`logsumexp(z) - sum_v p_v z_v` (verl's `entropy_from_logits`) subtracts two numbers of the size of the largest
logit to get an entropy that, for a peaked distribution, is many orders of magnitude smaller: its absolute error
is about eps * max|z|, which in bf16 (eps = 2^-8) is larger than the entropy itself. Every term of `p log p` is
small and of one sign, so its sum is accurate to a few ulps relative.
"""

from __future__ import annotations

import torch

from mcore_rl.algo.masked import check_shape, compute_dtype


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocab dimension, got shape {tuple(logits.shape)}")
    z = logits.to(compute_dtype(logits))
    if temperature != 1.0:
        z = z / temperature
    return _accurate_log_softmax(z)


def _accurate_log_softmax(z: torch.Tensor) -> torch.Tensor:
    """`log_softmax(z)` accurate to a few ulps even when one logit dominates.

    `F.log_softmax` computes `z - m - log(sum_v exp(z_v - m))`; the sum is `1 + tail` with a tail that, for a
    peaked distribution, is below float32's eps, so `log(1 + tail)` rounds to 0 and the top token's log-prob
    (and with it most of the entropy) is lost. Summing the tail without the top term and taking `log1p` keeps it.
    `m` is taken with its gradient (it flows to the top logit), which makes the autograd gradient exactly
    `onehot - softmax`, as for `F.log_softmax`.
    """
    top, top_index = z.max(dim=-1, keepdim=True)
    shifted = z - top
    tail = shifted.exp().scatter(-1, top_index, 0.0).sum(dim=-1, keepdim=True)
    return shifted - torch.log1p(tail)


def _gather(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    check_shape("targets", targets, log_probs.shape[:-1])
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    return torch.gather(log_probs, -1, targets.long().unsqueeze(-1)).squeeze(-1)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    # Where p underflows to 0 (or a logit is -inf, so log p = -inf), p log p is 0; the where() keeps
    # 0 * -inf = NaN out of both the value and the gradient.
    probs = log_probs.exp()
    safe_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * safe_log_probs).sum(dim=-1)


def log_probs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """`log softmax(logits / temperature)[target]`.

    Shapes: logits [..., V] (e.g. [B, T, V]), targets [...] integer ids -> [...] float32.
    """
    return _gather(_log_softmax(logits, temperature), targets)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of `softmax(logits / temperature)`, `-sum p log p`.

    Shapes: logits [..., V] -> [...] float32.
    """
    return _entropy(_log_softmax(logits, temperature))


def log_probs_and_entropy_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both of the above from a single log_softmax: (log-probs [...], entropy [...]), float32."""
    log_probs = _log_softmax(logits, temperature)
    return _gather(log_probs, targets), _entropy(log_probs)
