"""Fused kernels of the rollout engine's decode step (one new token per sequence, a few rows at a time).

A decode step of a small model is hundreds of tiny ops, where per-op dispatch and the poor efficiency of
batched GEMMs on matrices of a few rows dominate. CPU kernels (``csrc/decode_cpu.cpp``) cover a whole layer:
:func:`decode_linear` (projections of a few rows), :func:`rms_norm`, :func:`silu_mul` and
:func:`decode_attention`. Each runs
the compiled kernel for contiguous fp32 CPU tensors and otherwise its reference in
:mod:`mcore_rl.ops.reference` (bf16 / fp16, GPU, or no native build), which is also the test oracle.

Attention: rotary, KV-cache write and grouped-query attention, fused.

``decode_attention(qkv, cos, sin, keys, values, column, start, num_heads, scale)`` takes the new token of each
of ``b`` sequences (cache rows ``0..b-1``), all at cache column ``column``:

* ``qkv`` [b, (num_heads + 2 * kv_heads) * head_dim]: the fused projection, rows ``[q heads; k heads; v heads]``;
* ``cos`` / ``sin`` [b or 1, rotary_dim]: rotary tables at each row's position, ``sin`` signed
  (``[-sin, +sin]`` halves; non-interleaved rotary on the first ``rotary_dim`` dims of each head);
* ``keys`` [rows, kv_heads, head_dim, max_len] (transposed) and ``values`` [rows, kv_heads, max_len, head_dim]:
  the KV cache, updated in place at ``column`` with the rotated key and the value;
* ``start`` [b] int64 or None: the first cache column row ``i`` may see (left padding, sliding window); the
  row attends to columns ``[start[i], column]``, itself included;

and returns the attention context [b, num_heads * head_dim] (query head ``h`` reads KV head
``h // (num_heads // kv_heads)``), softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.ops import _native, reference


def _native_fp32(*tensors: Tensor) -> bool:
    return (
        _native.native_available()
        and tensors[0].device.type == "cpu"
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` for ``x`` [rows, hidden] (``torch.nn.RMSNorm``)."""
    if _native_fp32(x, weight) and x.dim() == 2:
        return torch.ops.mcore_rl.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for the fused projection ``gate_up`` [rows, 2f] = ``[gate | up]`` -> [rows, f]."""
    if _native_fp32(gate_up) and gate_up.dim() == 2:
        return torch.ops.mcore_rl.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`decode_linear` has a kernel for weights on ``device`` in ``dtype`` (CPU fp32)."""
    return _native.native_available() and device.type == "cpu" and dtype == torch.float32


def pack_panels(weight_t: Tensor) -> Tensor:
    """A projection ``x @ weight_t`` (``weight_t`` [K, N]) packed for :func:`decode_linear`: column panels
    [ceil(N / 16), K, 16], panel p holding columns [16p, 16p + 16) contiguously, zero-padded past N.

    One strided copy from either layout, so a row-major [N, K] weight (``weight_t`` its transposed view, as
    megatron and the sync hand it over) packs as fast as a column-major one: the realistic model's [32000,
    512] head in 7 ms, where padding a [K, N] copy first and transposing that took 17 ms from column-major
    storage, and storing the head column-major to begin with cost each weight sync about 60 ms more than
    a straight copy (2026-12-06, two threads). Equal to ``reference.pack_panels``."""
    k, n = weight_t.shape
    width = reference.PANEL_COLUMNS
    full = n // width
    panels = torch.empty(-(-n // width), k, width, dtype=weight_t.dtype, device=weight_t.device)
    if full:
        panels[:full].copy_(weight_t[:, : full * width].unflatten(1, (full, width)).transpose(0, 1))
    if full < panels.shape[0]:  # the last panel's columns past N are zeros
        panels[full].zero_()
        panels[full, :, : n - full * width].copy_(weight_t[:, full * width :])
    return panels


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections can run on MKL's packed GEMM (``mkl::_mkl_linear``, what torch's CPU inductor runs
    for frozen linears): fp32 on a CPU build of torch with MKL."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def mkl_pack(weight_t: Tensor, rows: int) -> Tensor:
    """``weight_t`` [K, N] as MKL's packed GEMM operand for products with exactly ``rows`` rows of input: MKL
    packs its operand inside every plain GEMM call, which for a decode step's few rows costs about a third
    of the call; packed once per weight load and batch size, decode steps skip it."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight_t.t(), rows)


def mkl_linear(
    x: Tensor, packed: Tensor, weight_t: Tensor, add: Tensor | None = None, rows: int = 0
) -> Tensor:
    """``add + x @ weight_t`` through :func:`mkl_pack`'s ``packed``, made for ``rows`` rows (>= ``x``'s; fewer run
    zero-padded to that count). Bitwise ``x @ weight_t`` of the padded rows, then the addition."""
    count = x.shape[0]
    if rows > count:
        x = torch.cat([x, x.new_zeros(rows - count, x.shape[1])])
    out = torch.ops.mkl._mkl_linear(x, packed, weight_t.t(), None, x.shape[0])[:count]
    return out if add is None else out.add_(add)


def decode_linear(x: Tensor, panels: Tensor, n: int, add: Tensor | None = None) -> Tensor:
    """``add + x @ W`` for ``x`` [M, K] and ``W`` [K, n] packed by :func:`pack_panels`; ``add`` None, a bias [n]
    or a residual [M, n]."""
    if _native_fp32(x, panels, *(() if add is None else (add,))):
        return torch.ops.mcore_rl.decode_linear(x, panels, n, add)
    return reference.decode_linear(x, panels, n, add)


def decode_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    column: int,
    start: Tensor | None,
    num_heads: int,
    scale: float,
) -> Tensor:
    if _native_fp32(qkv, cos, sin, keys, values):
        if (
            start is not None
        ):  # the kernel reads int64 starts; int32 ones (as the reference takes) are widened
            start = start.to(torch.int64).contiguous()
        return torch.ops.mcore_rl.decode_attention(
            qkv, cos, sin, keys, values, column, start, num_heads, scale
        )
    return reference.decode_attention(qkv, cos, sin, keys, values, column, start, num_heads, scale)


if _native.extension_loaded():

    @torch.library.register_fake("mcore_rl::decode_attention")
    def _(
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
        column: int,
        start: Tensor | None,
        num_heads: int,
        scale: float,
    ) -> Tensor:
        return qkv.new_empty(qkv.shape[0], num_heads * keys.shape[2])

    @torch.library.register_fake("mcore_rl::rms_norm")
    def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("mcore_rl::decode_linear")
    def _(x: Tensor, panels: Tensor, n: int, add: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("mcore_rl::silu_mul")
    def _(gate_up: Tensor) -> Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
