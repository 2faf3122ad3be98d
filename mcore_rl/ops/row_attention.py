"""Causal attention over shared-prompt rows (``engine/packing/shared_prefix.py``), with a fused CPU kernel.

Packed tokens ``query`` [T, heads, d], ``key`` / ``value`` [T, kv_heads, d] are attended in row layout: row
position p reads packed token ``source[p]`` (``rows = (b, s)`` positions), causal within the row, and packed
token t takes its output from row position ``home[t]``. A shared prompt token feeds every row of its group,
so its key and value gradients sum over those rows.

:func:`row_attention_reference` spells this with torch ops: gather the rows, torch's fused causal kernel,
gather the outputs back. :func:`row_attention` runs ``csrc/row_attention_cpu.cpp`` for fp32 CPU tensors,
which computes only each token's home query and reads keys and values straight from the packed tensors
(about 4x faster per layer on the issue-17 workload), and the reference elsewhere or without the extension.
The two agree to fp32 rounding. The kernel writes zeros for filler tokens (home to no row query), whose
outputs nothing reads; the reference gives them row position 0's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mcore_rl.ops import _native


def row_attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    source: Tensor,
    home: Tensor,
    rows: tuple[int, int],
    scale: float,
) -> Tensor:
    """-> [T, heads * d]. Row positions past a row's end read token 0 instead of a zero slot (no copy of the
    operands): causality keeps every real query of the row from seeing them, and their outputs are read by
    no token. Gathers use ``index_select``, whose backward (``index_add_``) is several times faster on CPU
    than the accumulating ``index_put_`` of advanced indexing."""
    b, s = rows

    def in_rows(t: Tensor) -> Tensor:  # [T, h, d] -> [b, h, s, d]
        return t.index_select(0, source).view(b, s, *t.shape[1:]).transpose(1, 2)

    q, k, v = in_rows(query), in_rows(key), in_rows(value)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2).reshape(b * s, -1).index_select(0, home)


class _RowAttention(torch.autograd.Function):
    """The fused kernel both ways; the forward saves each query's log-sum-exp for the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        source: Tensor,
        home: Tensor,
        segment_starts: Tensor,
        rows: tuple[int, int],
        scale: float,
    ) -> Tensor:
        out, lse = torch.ops.mcore_rl.row_attention(query, key, value, source, home, rows[0], rows[1], scale)
        ctx.save_for_backward(query, key, value, out, lse, source, home, segment_starts)
        ctx.rows, ctx.scale = rows, scale
        return out.view(out.shape[0], -1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse, source, home, starts = ctx.saved_tensors
        b, s = ctx.rows
        # the kernel reads unit-stride rows: out.sum().backward() sends an expanded (stride 0) gradient
        grad = grad.reshape(out.shape).contiguous()
        dq, dk, dv = torch.ops.mcore_rl.row_attention_backward(
            grad, query, key, value, out, lse, source, home, starts, b, s, ctx.scale
        )
        return dq, dk, dv, None, None, None, None, None


def _native_ok(*tensors: Tensor) -> bool:
    return (
        _native.native_available()
        and hasattr(torch.ops.mcore_rl, "row_attention")  # an extension built before the kernel lacks it
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    )


def row_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    source: Tensor,
    home: Tensor,
    segment_starts: Tensor,
    rows: tuple[int, int],
    scale: float,
) -> Tensor:
    """Module docstring; -> [T, heads * d]. ``source`` [b * s] and ``home`` [T] must be in range (row
    positions past a row's end read any token, e.g. 0; filler tokens' home is any position of no query of
    theirs, e.g. 0); ``segment_starts`` [segments + 1] bounds the packed segments, each holding every token
    its rows read (one shared prompt's group)."""
    if _native_ok(query, key, value):
        # the kernel reads int64 indices; int32 ones (as the reference takes them) are widened, not refused
        source, home, starts = (t.to(torch.int64).contiguous() for t in (source, home, segment_starts))
        return _RowAttention.apply(query, key, value, source, home, starts, rows, scale)
    return row_attention_reference(query, key, value, source, home, rows, scale)


if _native.extension_loaded() and hasattr(torch.ops.mcore_rl, "row_attention"):

    @torch.library.register_fake("mcore_rl::row_attention")
    def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
        return q.new_empty(q.shape), q.new_empty(q.shape[:2])

    @torch.library.register_fake("mcore_rl::row_attention_backward")
    def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
