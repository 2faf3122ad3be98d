"""Autograd blocks for training on CPU: RMSNorm, SwiGLU and rotary embeddings with hand-written backwards.

megatron's local layer spec spells these blocks out in small torch ops (``torch.nn.RMSNorm``'s composite,
``chunk -> silu -> mul`` for SwiGLU, ``cos/sin -> mul -> neg -> cat -> mul -> add -> cat`` for RoPE), and
autograd adds as many again in backward, with a ``cat`` for every ``chunk``. On a CPU, where a small model's
GEMMs take only about half of a training step, those passes over the activations are most of the rest. Each
function here computes the same formula in fewer passes: the backwards of RMSNorm and SwiGLU are one pass
each and the rotary one pass both ways, in ``csrc/train_blocks_cpu.cpp`` (fp32 CPU; elsewhere, or without
the extension, the pure-PyTorch versions below run).

The forwards are bitwise megatron's (the rollout decoder reproduces megatron's model exactly at TP1, and its
parity tests hold it to that); the backwards agree to fp32 rounding (their formulas are factored
differently). Every block has its unfused spelling here (``*_reference``): the forward and the test oracle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.ops import _native, decode

_NATIVE_OPS = ("swiglu_backward", "rms_norm_backward", "rope")


def _native_ops_built() -> bool:
    """Whether the loaded extension has this file's kernels (``csrc/train_blocks_cpu.cpp``); an extension
    built before they existed has the other ops only."""
    return _native.extension_loaded() and all(hasattr(torch.ops.mcore_rl, op) for op in _NATIVE_OPS)


def _native_fp32(*tensors: Tensor, contiguous: bool = True) -> bool:
    return (
        _native.native_available()
        and _native_ops_built()
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and (not contiguous or all(t.is_contiguous() for t in tensors))
    )


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``torch.nn.RMSNorm``: ``x * rsqrt(mean(x^2, -1) + eps) * weight``."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu_reference(gate_up: Tensor) -> Tensor:
    """megatron's gated linear unit: ``silu(gate) * up`` of ``[..., 2f] = [gate | up]``."""
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    return F.silu(gate) * up


def rope_reference(t: Tensor, freqs: Tensor) -> Tensor:
    """megatron's unfused non-interleaved rotary embedding (``_apply_rotary_pos_emb_bshd``, mscale 1):
    ``t`` [s, b, heads, d], ``freqs`` [s, 1, 1, r] with r <= d; the last ``d - r`` dims pass through."""
    rot = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    rotated = t_rot * torch.cos(freqs).to(t.dtype) + torch.cat((-x2, x1), -1) * torch.sin(freqs).to(t.dtype)
    return torch.cat((rotated, t_pass), dim=-1)


def _inv_rms(x: Tensor, eps: float) -> Tensor:
    """[rows, 1] ``rsqrt(mean(x^2) + eps)``, spelled as ``F.rms_norm`` computes it."""
    return (x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    """y = x * r * w with r = rsqrt(mean(x^2) + eps), per row of x [rows, h].

    Forward: torch's own (bitwise megatron's). Backward, with xhat = x * r and gw = grad * w:
    dw = sum_rows(grad * xhat) and dx = r * (gw - xhat * mean(gw * xhat)) (the mean over h), r recomputed
    (one reduction) rather than saved by autograd's composite with its intermediates."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_reference(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        if _native_fp32(grad, x, weight):
            grad_x, grad_weight = torch.ops.mcore_rl.rms_norm_backward(grad, x, weight, ctx.eps)
            return grad_x, grad_weight, None
        return (*_rms_norm_backward(grad, x, weight, ctx.eps), None)


def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The reference of ``mcore_rl::rms_norm_backward``: (d x, d weight)."""
    inv_rms = _inv_rms(x, eps)
    xhat = x * inv_rms
    grad_weight = (grad * xhat).sum(0)
    gw = grad * weight
    mean_dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1).div_(x.shape[-1])
    return gw.addcmul_(xhat, mean_dot, value=-1).mul_(inv_rms), grad_weight


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`rms_norm_reference` for fp32 ``x`` [..., h], with the fused backward."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return rms_norm_reference(x, weight, eps)
    shape = x.shape
    return _RMSNorm.apply(x.reshape(-1, shape[-1]).contiguous(), weight, eps).view(shape)


class _SwiGLU(torch.autograd.Function):
    """out = silu(gate) * up; backward: d_up = grad * silu(gate), d_gate = silu'(gate) * grad * up, written
    into the two halves of one [rows, 2f] buffer (autograd's ``chunk`` backward would ``cat`` them). The
    forward is bitwise megatron's spelling (the kernel ``mcore_rl::silu_mul`` computes ATen's formulas
    column for column, in one pass where ATen makes two); only the input is saved."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        return decode.silu_mul(gate_up)  # the kernel where built, else the reference: bitwise the same

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        if _native_fp32(grad, gate_up):
            return torch.ops.mcore_rl.swiglu_backward(grad, gate_up)
        return _swiglu_backward(grad, gate_up)


def _swiglu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """The reference of ``mcore_rl::swiglu_backward``: d/d[gate | up] of ``silu(gate) * up``."""
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    grad_gate_up = torch.empty_like(gate_up)
    grad_gate, grad_up = torch.chunk(grad_gate_up, 2, dim=-1)
    torch.mul(grad, F.silu(gate), out=grad_up)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
    return grad_gate_up


def swiglu(gate_up: Tensor) -> Tensor:
    """:func:`swiglu_reference` for fp32 ``gate_up`` [..., 2f], with the fused backward."""
    if gate_up.dtype != torch.float32:
        return swiglu_reference(gate_up)
    shape = gate_up.shape
    out = _SwiGLU.apply(gate_up.reshape(-1, shape[-1]).contiguous())
    return out.view(*shape[:-1], shape[-1] // 2)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """The rotation of the rotary dims of ``t`` in four half-width passes, pass-through dims copied. Forward:
    ``[x1 * c1 - x2 * s1 | x2 * c2 + x1 * s2]``; ``inverse``, its transpose (the backward):
    ``[x1 * c1 + x2 * s2 | x2 * c2 - x1 * s1]``."""
    rot = cos.shape[-1]
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    x1, x2 = torch.chunk(t[..., :rot], 2, dim=-1)
    o1, o2 = torch.chunk(out[..., :rot], 2, dim=-1)
    c1, c2 = torch.chunk(cos, 2, dim=-1)
    s1, s2 = torch.chunk(sin, 2, dim=-1)
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if inverse:
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)
    if rot < t.shape[-1]:
        out[..., rot:] = t[..., rot:]
    return out


class _Rope(torch.autograd.Function):
    """A rotation per position: the backward is the transposed rotation of the gradient (no saved input).
    ``cos`` / ``sin`` are [s, rot] tables for ``t`` [s, b, heads, d]."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rope(t, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rope(grad, cos, sin, inverse=True), None, None


def _rope(t: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """The kernel (bitwise megatron's forward: the same products and sums, no FMA), else megatron's
    spelling forward and ``_rotate`` backward. The kernel reads any [s, b, heads] strides; the key's gradient
    arrives transposed (head_dim not innermost) and is copied first, cheaper than four strided passes."""
    if _native_fp32(t, cos, sin, contiguous=False):
        return torch.ops.mcore_rl.rope(t if t.stride(-1) == 1 else t.contiguous(), cos, sin, inverse)
    cos, sin = cos[:, None, None], sin[:, None, None]
    if inverse:
        return _rotate(t, cos, sin, inverse=True)
    rot = cos.shape[-1]
    x1, x2 = torch.chunk(t[..., :rot], 2, dim=-1)
    rotated = t[..., :rot] * cos + torch.cat((-x2, x1), -1) * sin
    return torch.cat((rotated, t[..., rot:]), dim=-1)


def rope(t: Tensor, freqs: Tensor) -> Tensor:
    """:func:`rope_reference` for fp32 ``t``; no gradient flows to ``freqs`` (megatron's are buffers)."""
    seq, rot = t.shape[0], freqs.shape[-1]
    per_position = t.dim() == 4 and freqs.shape == (seq, 1, 1, rot) and rot % 2 == 0
    if t.dtype != torch.float32 or freqs.requires_grad or not per_position:
        return rope_reference(t, freqs)
    tables = freqs.reshape(seq, rot).float()
    return _Rope.apply(t, torch.cos(tables), torch.sin(tables))


if _native_ops_built():

    @torch.library.register_fake("mcore_rl::swiglu_backward")
    def _(grad: Tensor, gate_up: Tensor) -> Tensor:
        return torch.empty_like(gate_up)

    @torch.library.register_fake("mcore_rl::rms_norm_backward")
    def _(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return torch.empty_like(x), torch.empty_like(weight)

    @torch.library.register_fake("mcore_rl::rope")
    def _(t: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
        return t.new_empty(t.shape)
