"""The rollout decoder's attention over its KV cache (``rollout/decoder.py``): which cache columns each query
sees (left padding, the causal limit, a sliding window) and the attention itself, fused where the trainer's
local spec runs torch's fused kernel, spelled out with an fp32 softmax otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def first_visible(
    b: int, column: int, pad: Tensor | None, window: int | None, device: torch.device
) -> Tensor | None:
    """A decode query at ``column`` sees columns [first, column]: after the row's left padding and, with a
    sliding window W, after ``column - W``. None: every row sees every column from 0."""
    lowest = column - window + 1 if window is not None else 0
    if lowest <= 0:
        return pad
    if pad is None:
        return torch.full((b,), lowest, dtype=torch.long, device=device)
    return pad.clamp_min(lowest)


def attention_mask(
    column: int, s: int, pad: Tensor | None, window: int | None, device: torch.device
) -> Tensor | None:
    """[b or 1, 1, 1, s, key_len] bool, True where a query must NOT see a key: the future, the row's left
    padding, and with a sliding window W the keys at or before ``query - W``. None: nothing is masked."""
    key_len = column + s
    if s == 1 and pad is None and (window is None or key_len <= window):
        return None
    keys = torch.arange(key_len, device=device)
    queries = torch.arange(column, key_len, device=device)[:, None]
    masked = keys > queries  # [s, key_len]
    if window is not None:
        masked = masked | (keys <= queries - window)
    if pad is not None:
        masked = masked | (keys < pad[:, None, None])  # [b, s, key_len]
    return masked.view(-1, 1, 1, s, key_len)


def attend_causal(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """:func:`attend` for whole unpadded rows from column 0 without a window: torch's fused causal
    kernel on the shapes megatron's trainer gives it (``compat.cpu_layers.SdpaDotProductAttention``),
    which keeps the TP1 logits bitwise equal to the trainer's. -> [b * s, heads * hd]."""
    b, s, nh, hd = q.shape
    # Contiguous operands, as the trainer passes them: the kernel's rounding follows the strides.
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).contiguous(),
        keys.transpose(2, 3).contiguous(),
        values.contiguous(),
        is_causal=True,
        scale=scale,
        enable_gqa=keys.shape[1] != nh,
    )
    return out.transpose(1, 2).reshape(b * s, nh * hd)


def attend(q: Tensor, keys: Tensor, values: Tensor, masked: Tensor | None, scale: float) -> Tensor:
    """q [b, s, heads, hd], keys [b, kv, hd, key_len], values [b, kv, key_len, hd] -> context
    [b * s, heads * hd].

    The query heads of one KV head are folded into the matmul's row dim instead of repeating keys, and
    the softmax runs in fp32 like megatron's (``attention_softmax_in_fp32``). Masked scores get the
    most negative float rather than -inf: a query that sees nothing (a left-pad column) then averages
    finite values instead of producing NaN; for every other query the two are identical, since
    ``exp(min - max)`` is exactly 0.
    """
    b, s, nh, hd = q.shape
    nkv, key_len = keys.shape[1], keys.shape[3]
    group = nh // nkv
    # 3-D views for bmm directly (torch.matmul on 4-D adds a dozen expand/reshape calls per layer).
    q = q.reshape(b, s, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(b * nkv, group * s, hd)
    scores = torch.bmm(q, keys.reshape(b * nkv, hd, key_len)).mul_(scale)
    if scores.dtype != torch.float32:
        scores = scores.float()
    if masked is not None:
        scores = scores.view(b, nkv, group, s, key_len).masked_fill_(masked, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores.view(b * nkv, group * s, key_len), dim=-1)
    if probs.dtype != values.dtype:
        probs = probs.to(values.dtype)
    context = torch.bmm(probs, values.reshape(b * nkv, key_len, hd))  # [b * kv, group * s, hd]
    return context.view(b, nkv, group, s, hd).permute(0, 3, 1, 2, 4).reshape(b * s, nh * hd)
