"""Rotary position embedding as ``transformers`` computes it: the inverse frequencies of each rope type
(default, linear, Llama 3.1's ``llama3``, ``yarn``) and YaRN's attention factor.

The actor (megatron's ``RotaryEmbedding``, whose ``inv_freq`` we replace: megatron hard-codes llama3's
constants and builds YaRN only as a position-embedding type of its own) and the embedded rollout engine
(``engine/rollout/rotary.py``) both read their frequencies here, so they rotate alike and as transformers
does, bit for bit (``tests/engine/test_arch.py`` holds each type to transformers' own function).

YaRN also multiplies cos and sin by an attention factor ``a`` (transformers' ``attention_scaling``). Both q
and k carry it, so every attention logit is ``a**2`` times the unscaled one: we fold ``a**2`` into the
softmax scale (:func:`attention_softmax_scale`) instead of scaling the tables, which is exact in real
arithmetic because these families rotate the whole head (``partial_rotary_factor`` 1, checked in
``engine/arch.py``); in fp32 it differs from transformers' rounding by about 1e-7.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Rotary inverse frequencies [rotary_dim / 2], fp32, computed as ``transformers`` computes them."""
    dim = arch.rotary_dim
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "yarn":
        return _yarn_inv_freq(arch, scaling)
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def rope_attention_factor(arch: ModelArch) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (``attention_factor`` when the config
    gives it, else from ``factor`` and, when both are set, ``mscale`` / ``mscale_all_dim``, as DeepSeek's
    configs have them); 1.0 for every other rope type."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def attention_softmax_scale(arch: ModelArch) -> float:
    """The attention logits' scale: ``1 / sqrt(head_dim)`` spelled as megatron computes its default (``** -0.5``
    can differ by an ulp), times the square of :func:`rope_attention_factor` (exactly the default when 1)."""
    return 1.0 / math.sqrt(arch.head_dim) * rope_attention_factor(arch) ** 2


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 rope scaling: long wavelengths slowed by ``factor``, short kept, a smooth band between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 ln(s) + 1`` (times ``mscale`` on the log), 1 for no growth; spelled as transformers does."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(arch: ModelArch, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): the dimensions that turn fewer than ``beta_slow`` times over the pretraining
    length are interpolated (slowed by ``factor``), those that turn more than ``beta_fast`` times kept, and a
    linear ramp blends the band between. Every operation in transformers' order, so the result is bitwise
    its ``_compute_yarn_parameters``."""
    dim, base = arch.rotary_dim, arch.rope_theta
    factor = float(scaling["factor"])
    pretrained = scaling.get("original_max_position_embeddings") or arch.max_position_embeddings
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _turns_to_dim(beta_fast, dim, base, pretrained)
    high = _turns_to_dim(beta_slow, dim, base, pretrained)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero when the band is empty
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - ramp  # the share of each dimension's unscaled frequency
    return interpolated * (1 - kept) + extrapolated * kept


def _turns_to_dim(turns: float, dim: int, base: float, length: int) -> float:
    """The rotary dimension whose wave turns ``turns`` times over ``length`` positions."""
    return (dim * math.log(length / (turns * 2 * math.pi))) / (2 * math.log(base))
