"""Causal attention over shared-prompt rows (``ops/row_attention.py``, ``csrc/row_attention_cpu.cpp``): the
fused kernel against the reference (gather rows -> torch's fused attention -> gather outputs), forward and
every gradient, computed in fp64 as the oracle; on packings that exercise the kernel's edges."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.packing.shared_prefix import shared_prefix_packing, shared_prefix_seq_params
from mcore_rl.ops import _native
from mcore_rl.ops.row_attention import _native_ok, row_attention, row_attention_reference

pytestmark = pytest.mark.skipif(
    not (_native.extension_loaded() and hasattr(torch.ops.mcore_rl, "row_attention")),
    reason="mcore_rl._C is not built with csrc/row_attention_cpu.cpp",
)


def _packing(groups: int, n: int, prompt: int, width: int, seed: int, multiple: int = 1):
    """``groups`` prompts x ``n`` samples of random response lengths (one sample without a response), packed
    with each prompt once; -> (seq params, whether each packed token is some row's home)."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * n
    tokens = torch.randint(1, 50, (rows, width), generator=gen)
    tokens[:, :prompt] = torch.randint(1, 50, (groups, prompt), generator=gen).repeat_interleave(n, 0)
    mask = torch.zeros(rows, width)
    for row in range(rows):
        length = int(torch.randint(1, width - prompt + 1, (1,), generator=gen))
        mask[row, prompt - 1 : prompt - 1 + length] = 1.0
        tokens[row, prompt + length :] = 0
    mask[-1] = 0.0  # a row without a response: a segment of its own
    packed = shared_prefix_packing(tokens, mask, multiple=multiple)
    return shared_prefix_seq_params(packed), packed.home < rows * width


def _operands(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as megatron hands them: strided views of one QKV projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def _run(fn, q, k, v, grad, *args):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, *args)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "width"),
    [(8, 8, 32, 48), (4, 2, 24, 150), (6, 1, 36, 40), (2, 2, 8, 9)],
    ids=["mha", "gqa-rows-past-a-chunk", "mqa-odd-head-dim", "tiny"],
)
def test_kernel_matches_the_reference_forward_and_backward(heads, kv_heads, head_dim, width) -> None:
    params, home = _packing(groups=3, n=4, prompt=min(16, width // 3), width=width, seed=width, multiple=8)
    q, k, v = _operands(params.positions.numel(), heads, kv_heads, head_dim, seed=heads)
    assert _native_ok(q, k, v) and not q.is_contiguous()
    grad = torch.randn(q.shape[0], heads * head_dim) * home[:, None]  # nothing reads a filler's output
    scale = head_dim**-0.5
    maps = (params.row_source, params.token_home)
    out, grads = _run(row_attention, q, k, v, grad, *maps, params.cu_seqlens_q, params.rows, scale)
    ref, ref_grads = _run(
        row_attention_reference, *(t.double() for t in (q, k, v)), grad.double(), *maps, params.rows, scale
    )
    assert (out - ref)[home].abs().max() <= 1e-5
    assert torch.all(out[~home] == 0)  # filler tokens: zeros (the reference gives position 0's output)
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


def test_int32_index_maps_give_the_int64_result() -> None:
    """The kernel reads int64 maps; the wrapper widens int32 ones (the reference takes either)."""
    params, _ = _packing(groups=2, n=3, prompt=5, width=12, seed=3)
    q, k, v = _operands(params.positions.numel(), 4, 2, 8, seed=1)
    outs = [
        row_attention(
            q,
            k,
            v,
            params.row_source.to(t),
            params.token_home.to(t),
            params.cu_seqlens_q.to(t),
            params.rows,
            0.3,
        )
        for t in (torch.int64, torch.int32)
    ]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("layout", ["expanded", "column-strided"])
def test_the_backward_takes_a_gradient_of_any_layout(layout: str) -> None:
    # out.sum().backward() sends an expanded (stride 0) gradient; the kernel wants unit-stride rows
    params, home = _packing(groups=2, n=2, prompt=4, width=12, seed=1)
    q, k, v = _operands(params.positions.numel(), 2, 2, 8, seed=2)
    shape = (q.shape[0], 16)
    dense = torch.randn(shape) * home[:, None]
    grad = dense.t().contiguous().t() if layout == "column-strided" else torch.ones(()).expand(shape)
    maps = (params.row_source, params.token_home)
    _, grads = _run(row_attention, q, k, v, grad, *maps, params.cu_seqlens_q, params.rows, 8**-0.5)
    _, want = _run(
        row_attention, q, k, v, grad.contiguous(), *maps, params.cu_seqlens_q, params.rows, 8**-0.5
    )
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_the_kernel_refuses_maps_out_of_range_and_rows_outside_their_segment() -> None:
    params, _ = _packing(groups=2, n=2, prompt=3, width=8, seed=0)
    q, k, v = _operands(params.positions.numel(), 2, 2, 8, seed=0)
    b, s = params.rows
    bad_source = params.row_source.clone()
    bad_source[0] = q.shape[0]
    with pytest.raises(RuntimeError, match="source entries must be packed token indices"):
        torch.ops.mcore_rl.row_attention(q, k, v, bad_source, params.token_home, b, s, 1.0)
    out, lse = torch.ops.mcore_rl.row_attention(q, k, v, params.row_source, params.token_home, b, s, 1.0)
    torch.library.opcheck(
        torch.ops.mcore_rl.row_attention.default, (q, k, v, params.row_source, params.token_home, b, s, 1.0)
    )
    starts = params.cu_seqlens_q.long()
    backward_args = (out, q, k, v, out, lse, params.row_source, params.token_home, starts, b, s, 1.0)
    torch.library.opcheck(torch.ops.mcore_rl.row_attention_backward.default, backward_args)
    one_segment = torch.tensor([0, 1, q.shape[0]])  # the first row's tokens span both "segments"
    with pytest.raises(RuntimeError, match="reads tokens outside its packed segment"):
        torch.ops.mcore_rl.row_attention_backward(
            out, q, k, v, out, lse, params.row_source, params.token_home, one_segment, b, s, 1.0
        )


def test_the_reference_runs_where_the_kernel_does_not(monkeypatch) -> None:
    params, home = _packing(groups=2, n=3, prompt=4, width=12, seed=1)
    q, k, v = _operands(params.positions.numel(), 4, 2, 16, seed=1)
    args = (params.row_source, params.token_home, params.cu_seqlens_q, params.rows, 0.25)
    native = row_attention(q, k, v, *args)
    monkeypatch.setenv("MCORE_RL_FORCE_REFERENCE", "1")
    assert not _native_ok(q, k, v)
    reference = row_attention(q, k, v, *args)
    assert (native - reference)[home].abs().max() <= 1e-5
    assert not _native_ok(q.double(), k.double(), v.double())
