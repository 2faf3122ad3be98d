"""Token sampling from full-vocab logits: temperature, top-k, top-p, greedy, and the reported log-probs.

Pure tensor functions (no model, no process group), so they are tested on hand-made distributions. Every
TP rank calls :func:`sample_tokens` on the same all-gathered logits with an identically seeded generator,
so all ranks draw the same tokens without a broadcast.

Sampling inverts the CDF with one uniform number per row: ``softmax`` over the candidates, a cumulative
sum in float64 (fp32 would drift by up to ``V * eps`` over a large vocab), and a binary search. It is ~10x
cheaper on CPU than drawing one Gumbel/exponential number per vocab entry (vLLM's way) or
``torch.multinomial``. Filtered tokens get ``z = -inf``, probability 0, and can never be drawn.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.ops import _native


def log_probs_of(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / T)[token]`` per row: logits [n, V], tokens [n] -> [n] fp32.

    Only the log-sum-exp and one gathered logit are needed, not the whole log-softmax.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _top_p_mask(sorted_z: Tensor, top_p: float) -> Tensor:
    """[n, k] bool over descending-sorted logits: True for tokens outside the nucleus, i.e. whose
    preceding cumulative probability already reaches ``top_p``. The most likely token always stays."""
    probs = torch.softmax(sorted_z, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    outside = before >= top_p
    outside[:, 0] = False
    return outside


def filtered_candidates(z: Tensor, top_k: int, top_p: float) -> tuple[Tensor, Tensor | None]:
    """Logits restricted by top-k then top-p: ``(candidate logits [n, k], their token ids [n, k] or None)``.

    None ids means the candidates are the whole vocab in order (nothing filtered, nothing sorted).
    Removed candidates hold -inf.
    """
    vocab = z.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return z, None
    if top_p >= 1.0:
        values, ids = torch.topk(z, k, dim=-1)
        return values, ids
    values, ids = torch.sort(z, dim=-1, descending=True)
    values, ids = values[:, :k], ids[:, :k]
    return values.masked_fill(_top_p_mask(values, top_p), float("-inf")), ids


def draw(z: Tensor, generator: torch.Generator) -> Tensor:
    """One index per row of ``z`` [n, k], drawn from ``softmax(z)`` -> [n] int64."""
    cdf = torch.cumsum(torch.softmax(z, dim=-1), dim=-1, dtype=torch.float64)
    u = torch.rand(z.shape[0], 1, generator=generator, dtype=torch.float64, device=z.device)
    # First index whose cdf exceeds u: a zero-probability entry never does (its cdf equals its
    # predecessor's). The clamp only guards u * total rounding up to total.
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(z.shape[1] - 1)


def sample_tokens(
    logits: Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """One token per row of fp32 ``logits`` [n, V] -> (tokens [n] int64, log-probs [n] fp32).

    The log-probs are those of the unfiltered distribution at the sampling temperature (see
    ``rollout/base.py``), so the actor can recompute them exactly.
    """
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, log_probs_of(logits, tokens, 1.0)
    z = logits.float()
    if params.temperature != 1.0:
        z = z / params.temperature
    candidates, ids = filtered_candidates(z, params.top_k, params.top_p)
    if ids is None:
        return _draw_unfiltered(z, generator)
    choice = draw(candidates, generator)
    tokens = ids.gather(-1, choice[:, None]).squeeze(-1)
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _draw_unfiltered(z: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """:func:`draw` over the whole vocab and the log-probs, sharing one ``exp(z - max)`` pass.

    The common RL case (no top-k / top-p) runs once per decode step: ``softmax`` + ``logsumexp`` would
    exponentiate the vocab twice. The CDF is left unnormalised (the draw scales ``u`` by its total instead),
    and ``log(total)`` is the log-sum-exp, summed in float64. On CPU in fp32 one kernel does all of it
    (``csrc/sample_cpu.cpp``, one pass per row instead of ~15 ops); the spelling below is its reference.
    """
    u = torch.rand(z.shape[0], 1, generator=generator, dtype=torch.float64, device=z.device)
    if _native_sampling(z):
        tokens, log_probs = torch.ops.mcore_rl.sample_unfiltered(z, u)
        return tokens, log_probs
    return draw_unfiltered_reference(z, u)


def _native_sampling(z: Tensor) -> bool:
    return (
        z.device.type == "cpu"
        and z.dtype == torch.float32
        and z.is_contiguous()
        and _native.native_available()
        and hasattr(torch.ops.mcore_rl, "sample_unfiltered")
    )


def draw_unfiltered_reference(z: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, log-probs) drawn from ``softmax(z)`` [n, V] with the uniform numbers ``u`` [n, 1] float64."""
    top = z.amax(dim=-1, keepdim=True)  # [n, 1]
    cdf = torch.cumsum((z - top).exp_(), dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u * total, right=True).squeeze(1).clamp_max_(z.shape[1] - 1)
    log_probs = (z.gather(-1, tokens[:, None]) - top).squeeze(-1) - total.log().squeeze(-1)
    return tokens, log_probs.float()
