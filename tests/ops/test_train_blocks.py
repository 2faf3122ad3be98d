"""Training blocks with hand-written backwards (RMSNorm, SwiGLU, rotary): the backward formulas by gradcheck
in fp64, and the fp32 entry points against their unfused references (megatron's own rotary and SwiGLU among
them) to 1e-5 (the forwards bitwise), on the compiled kernels and on the references (the ``impl`` fixture);
the backward kernels against their references directly, with ``opcheck``."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.ops import train_blocks


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()


def _rope_freqs(seq: int, rot: int) -> torch.Tensor:
    """[s, 1, 1, rot] as megatron's RotaryEmbedding builds them: the same angles in both halves."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def test_backwards_pass_gradcheck_in_fp64() -> None:
    x, weight = _rand(5, 7, seed=0, dtype=torch.float64), _rand(7, seed=1, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, w: train_blocks._RMSNorm.apply(a, w, 1e-6), (x, weight))
    gate_up = _rand(6, 10, seed=2, dtype=torch.float64)
    assert torch.autograd.gradcheck(train_blocks._SwiGLU.apply, (gate_up,))
    # Independent angles in the two halves and a pass-through tail: every term of the rotation is checked.
    t = _rand(3, 2, 2, 10, seed=3, dtype=torch.float64)
    freqs = _rand(3, 6, seed=4, dtype=torch.float64).detach()
    assert torch.autograd.gradcheck(
        lambda a: train_blocks._Rope.apply(a, torch.cos(freqs), torch.sin(freqs)), (t,)
    )


def _forward_backward(fn, *inputs: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    grads = [t.grad.clone() for t in inputs if t.grad is not None]
    assert len(grads) == len(inputs)
    for t in inputs:
        t.grad = None
    return out.detach(), grads


def _assert_close(fused, reference) -> None:
    (out, grads), (ref_out, ref_grads) = fused, reference
    assert out.shape == ref_out.shape
    assert (out - ref_out).abs().max() <= 1e-5
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert (grad - ref_grad).abs().max() <= 1e-5


@pytest.mark.parametrize("shape", [(6, 3, 64), (5, 37)], ids=["sbh", "rows-odd-width"])
def test_rms_norm_matches_torch(impl, shape) -> None:
    x, weight = _rand(*shape, seed=5), _rand(shape[-1], seed=6)
    fused = _forward_backward(lambda a, w: train_blocks.rms_norm(a, w, 1e-5), x, weight, seed=7)
    ref = _forward_backward(lambda a, w: train_blocks.rms_norm_reference(a, w, 1e-5), x, weight, seed=7)
    _assert_close(fused, ref)
    assert torch.equal(fused[0], ref[0])


def test_swiglu_matches_megatron_glu(impl, monkeypatch) -> None:
    from megatron.core.fusions import fused_bias_swiglu

    # megatron's fused-SwiGLU entry (the ``bias_activation_fusion`` slot ours fills), its own forward and
    # hand-written backward (``swiglu_back``); their ``torch.compile`` is undone, as it compiles C++ on a CPU at
    # first use and computes the same formulas
    for name in ("swiglu", "swiglu_back"):
        fn = getattr(fused_bias_swiglu, name)
        monkeypatch.setattr(fused_bias_swiglu, name, getattr(fn, "__wrapped__", fn))
    gate_up = _rand(6, 3, 2 * 45, seed=8)
    fused = _forward_backward(train_blocks.swiglu, gate_up, seed=9)
    ref = _forward_backward(train_blocks.swiglu_reference, gate_up, seed=9)
    megatron = _forward_backward(lambda a: fused_bias_swiglu.bias_swiglu_impl(a, None), gate_up, seed=9)
    assert fused[0].shape == (6, 3, 45)
    _assert_close(fused, ref)
    assert torch.equal(fused[0], ref[0])
    _assert_close(fused, megatron)
    assert torch.equal(fused[0], megatron[0])  # the forward is megatron's, bitwise


@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
def test_rope_matches_megatron(impl, rot) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = _rand(12, 2, 4, 16, seed=10)
    freqs = _rope_freqs(12, rot)
    fused = _forward_backward(lambda a: train_blocks.rope(a, freqs), t, seed=11)
    ref = _forward_backward(lambda a: train_blocks.rope_reference(a, freqs), t, seed=11)
    megatron = _forward_backward(lambda a: _apply_rotary_pos_emb_bshd(a, freqs), t, seed=11)
    _assert_close(fused, ref)
    _assert_close(fused, megatron)
    assert torch.equal(fused[0], megatron[0])  # the forward is megatron's, bitwise


def test_strided_query_view_and_other_dtypes() -> None:
    """megatron hands rotary a strided slice of the fused QKV projection; bf16 runs the references."""
    qkv = _rand(8, 2, 4, 48, seed=12)
    query = qkv[..., :16]
    freqs = _rope_freqs(8, 16)
    fused = _forward_backward(lambda a: train_blocks.rope(a[..., :16], freqs), qkv, seed=13)
    ref = _forward_backward(lambda a: train_blocks.rope_reference(a[..., :16], freqs), qkv, seed=13)
    assert not query.is_contiguous()
    _assert_close(fused, ref)
    x = _rand(4, 32, seed=14, dtype=torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    expected = train_blocks.rms_norm_reference(x, weight, 1e-5)
    assert torch.equal(train_blocks.rms_norm(x, weight, 1e-5), expected)


@pytest.mark.parametrize("rows", [1, 37], ids=["one-row", "rows-past-a-task"])
def test_native_backwards_match_their_references(rows) -> None:
    if not train_blocks._native_ops_built():
        pytest.skip("mcore_rl._C is not built with csrc/train_blocks_cpu.cpp")
    gen = torch.Generator().manual_seed(rows)
    gate_up, grad = torch.randn(rows, 2 * 45, generator=gen), torch.randn(rows, 45, generator=gen)
    native = torch.ops.mcore_rl.swiglu_backward(grad, gate_up)
    assert (native - train_blocks._swiglu_backward(grad, gate_up)).abs().max() <= 1e-5
    x, g, weight = (
        torch.randn(rows, 37, generator=gen),
        torch.randn(rows, 37, generator=gen),
        torch.randn(37, generator=gen),
    )
    grad_x, grad_weight = torch.ops.mcore_rl.rms_norm_backward(g, x, weight, 1e-6)
    ref_x, ref_weight = train_blocks._rms_norm_backward(g, x, weight, 1e-6)
    assert (grad_x - ref_x).abs().max() <= 1e-5
    assert (grad_weight - ref_weight).abs().max() <= 1e-5
    torch.library.opcheck(torch.ops.mcore_rl.swiglu_backward.default, (grad, gate_up))
    torch.library.opcheck(torch.ops.mcore_rl.rms_norm_backward.default, (g, x, weight, 1e-6))


@pytest.mark.parametrize("rot", [24, 8, 2], ids=["full", "partial", "one-pair"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_native_rope_matches_reference_on_strided_views(rot, inverse) -> None:
    if not train_blocks._native_ops_built():
        pytest.skip("mcore_rl._C is not built with csrc/train_blocks_cpu.cpp")
    gen = torch.Generator().manual_seed(rot)
    qkv = torch.randn(7, 3, 5, 3 * 24, generator=gen)
    t = qkv[..., 24:48]  # a key-like view: strided along s, b and heads
    cos, sin = torch.randn(7, rot, generator=gen), torch.randn(7, rot, generator=gen)
    native = torch.ops.mcore_rl.rope(t, cos, sin, inverse)
    expected = train_blocks._rotate(t, cos[:, None, None], sin[:, None, None], inverse)
    assert native.is_contiguous() and native.shape == t.shape
    assert (native - expected).abs().max() <= 1e-5
    torch.library.opcheck(torch.ops.mcore_rl.rope.default, (t, cos, sin, inverse))
