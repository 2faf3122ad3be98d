"""Decode-step kernels (attention with KV-cache write, packed small-batch linear, RMSNorm, SiLU-gate) against
the fp64 references, on the compiled kernels and on the fp32 references (the ``impl`` fixture)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.ops import _native, decode, reference

# (batch, heads, kv heads, head_dim, rotary_dim): MHA, GQA 2 and 4, MQA; head_dim not a multiple of the
# vector width; partial rotary.
ATTENTION_SHAPES = [
    (3, 4, 4, 16, 16),
    (5, 8, 4, 32, 32),
    (2, 8, 2, 12, 12),
    (4, 6, 1, 24, 8),
    (1, 4, 2, 64, 32),
]


def _cache(rows: int, kv: int, head_dim: int, max_len: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    keys = torch.randn(rows, kv, head_dim, max_len, generator=gen)
    values = torch.randn(rows, kv, max_len, head_dim, generator=gen)
    return keys, values


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "b{}-h{}-kv{}-d{}-rot{}".format(*s))
@pytest.mark.parametrize("column", [0, 5, 37])
@pytest.mark.parametrize("masked", [False, True], ids=["all-visible", "start"])
def test_decode_attention_matches_fp64_reference(impl, shape, column, masked) -> None:
    b, heads, kv, head_dim, rot = shape
    gen = torch.Generator().manual_seed(column * 10 + b)
    qkv = torch.randn(b, (heads + 2 * kv) * head_dim, generator=gen)
    cos_rows = 1 if b % 2 else b  # shared tables (no padding) and per-row tables (left padding)
    cos, sin = torch.randn(cos_rows, rot, generator=gen), torch.randn(cos_rows, rot, generator=gen)
    keys, values = _cache(b + 2, kv, head_dim, 40, gen)  # more cache rows than live sequences
    start = torch.randint(0, column + 1, (b,), generator=gen) if masked else None
    ref_keys, ref_values = keys.double(), values.double()

    out = decode.decode_attention(qkv, cos, sin, keys, values, column, start, heads, 0.3)
    expected = reference.decode_attention(
        qkv.double(), cos.double(), sin.double(), ref_keys, ref_values, column, start, heads, 0.3
    )
    assert out.dtype == torch.float32 and out.shape == (b, heads * head_dim)
    assert float((out.double() - expected).abs().max()) < 1e-5
    # The new key (rotated) and value land in column `column` of the live rows; nothing else changes.
    assert torch.allclose(keys.double(), ref_keys, atol=1e-6) and torch.allclose(values.double(), ref_values)
    written = torch.zeros_like(keys, dtype=torch.bool)
    written[:b, :, :, column] = True
    assert torch.equal(keys[~written].double(), ref_keys[~written])


def test_decode_attention_start_hides_earlier_columns(impl) -> None:
    """Columns before ``start`` have no influence at all (left padding, sliding window)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 4 * 8, generator=gen)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    keys, values = _cache(2, 1, 8, 12, gen)
    start = torch.tensor([4, 7])
    first = decode.decode_attention(qkv, cos, sin, keys.clone(), values.clone(), 9, start, 2, 0.5)
    keys[:, :, :, :4], values[:, :, :4] = 1e4, -1e4  # garbage where nobody may look
    second = decode.decode_attention(qkv, cos, sin, keys, values, 9, start, 2, 0.5)
    assert torch.equal(first, second)


def test_decode_attention_takes_int32_starts_as_the_reference_does(impl) -> None:
    """The kernel reads int64 starts; the wrapper widens int32 ones rather than refusing what the reference
    (and any caller on a path without the extension) takes."""
    gen = torch.Generator().manual_seed(1)
    qkv, cos, sin = torch.randn(2, 4 * 8, generator=gen), torch.ones(1, 8), torch.zeros(1, 8)
    keys, values = _cache(2, 1, 8, 12, gen)
    outs = [
        decode.decode_attention(
            qkv, cos, sin, keys.clone(), values.clone(), 9, torch.tensor([4, 7], dtype=t), 2, 0.5
        )
        for t in (torch.int64, torch.int32)
    ]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
@pytest.mark.parametrize("k_dim, n_dim", [(33, 23), (64, 16), (256, 1000), (40, 8)])
@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_decode_linear_matches_fp64(impl, rows, k_dim, n_dim, add) -> None:
    gen = torch.Generator().manual_seed(rows + n_dim)
    x = torch.randn(rows, k_dim, generator=gen)
    wide = torch.randn(k_dim, n_dim + 5, generator=gen)
    weight_t = wide[:, :n_dim]  # a column slice of a wider matrix, as the decoder's vocab-trimmed head
    extra = {"none": None, "bias": torch.randn(n_dim), "residual": torch.randn(rows, n_dim)}[add]
    panels = decode.pack_panels(weight_t)
    assert panels.shape == (-(-n_dim // 16), k_dim, 16)
    out = decode.decode_linear(x, panels, n_dim, extra)
    expected = x.double() @ weight_t.double() + (0 if extra is None else extra.double())
    assert out.shape == (rows, n_dim)
    assert float((out.double() - expected).abs().max()) < 1e-4 * k_dim**0.5


@pytest.mark.skipif(
    not _native.extension_loaded() or torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="needs the compiled kernels on a CPU with AVX-512",
)
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 16, 25, 64])
@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_decode_linear_avx512_kernel_equals_avx2_bit_for_bit(rows, add, monkeypatch) -> None:
    """The AVX-512 kernel runs each output's FMA chain over k in the AVX2 kernel's order: same bits, for every
    row-block size (1-12, split blocks), a lone last full panel (N = 48: a pair and one) and a partial one."""
    gen = torch.Generator().manual_seed(rows)
    for k_dim, n_dim in [(96, 48), (200, 1000), (17, 40)]:
        x, weight_t = torch.randn(rows, k_dim, generator=gen), torch.randn(k_dim, n_dim, generator=gen)
        extra = {"none": None, "bias": torch.randn(n_dim), "residual": torch.randn(rows, n_dim)}[add]
        panels = decode.pack_panels(weight_t)
        wide = torch.ops.mcore_rl.decode_linear(x, panels, n_dim, extra)
        monkeypatch.setenv("MCORE_RL_DECODE_ISA", "avx2")
        narrow = torch.ops.mcore_rl.decode_linear(x, panels, n_dim, extra)
        monkeypatch.delenv("MCORE_RL_DECODE_ISA")
        assert torch.equal(wide, narrow), (k_dim, n_dim)


@pytest.mark.skipif(
    not _native.extension_loaded() or torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="needs the compiled kernels on a CPU with AVX-512",
)
@pytest.mark.parametrize(
    "heads, kv, head_dim", [(8, 2, 64), (4, 4, 128), (6, 2, 80), (7, 1, 12), (16, 2, 32), (2, 1, 40)]
)
def test_decode_attention_avx512_kernel_equals_avx2_bit_for_bit(heads, kv, head_dim, monkeypatch) -> None:
    """The AVX-512 products (csrc/decode_attention_avx512.cpp) run every score's FMA chain over head_dim and
    every context element's over the cache columns in the AVX2 kernels' order: the same bits for query groups
    of 4 + 2 + 1 heads, head_dim tails (80, 12, 40), column counts on and off the block widths (1, 16, 64,
    100, 301), with and without hidden leading columns."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    b, max_len = 3, 320
    qkv = torch.randn(b, (heads + 2 * kv) * head_dim, generator=gen)
    cos, sin = torch.randn(1, head_dim, generator=gen), torch.randn(1, head_dim, generator=gen)
    for column in (0, 15, 63, 99, 300):
        for start in (None, torch.tensor([0, column // 3, column])):
            keys, values = _cache(b, kv, head_dim, max_len, gen)
            wide = decode.decode_attention(
                qkv, cos, sin, keys.clone(), values.clone(), column, start, heads, 0.2
            )
            monkeypatch.setenv("MCORE_RL_DECODE_ISA", "avx2")
            narrow = decode.decode_attention(qkv, cos, sin, keys, values, column, start, heads, 0.2)
            monkeypatch.delenv("MCORE_RL_DECODE_ISA")
            assert torch.equal(wide, narrow), (column, start)


def test_pack_panels_layout() -> None:
    weight_t = torch.arange(3 * 20, dtype=torch.float32).view(3, 20)
    panels = decode.pack_panels(weight_t)
    assert torch.equal(panels[0], weight_t[:, :16])
    assert torch.equal(panels[1, :, :4], weight_t[:, 16:]) and not panels[1, :, 4:].any()


@pytest.mark.parametrize("n_dim", [1, 16, 20, 48, 77])
def test_pack_panels_equals_the_reference_from_either_layout(n_dim) -> None:
    """The strided pack reads a row-major weight's transposed view (how the decoder stores projections where
    panels run) and a column-major [K, N] buffer alike, into the reference's panels."""
    weight = torch.randn(n_dim, 24, generator=torch.Generator().manual_seed(n_dim))
    expected = reference.pack_panels(weight.t().contiguous())
    for weight_t in (weight.t(), weight.t().contiguous()):
        assert torch.equal(decode.pack_panels(weight_t), expected)


def test_rms_norm_and_silu_mul_match_fp64(impl) -> None:
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(7, 300, generator=gen) * 3, torch.randn(300, generator=gen)
    expected = reference.rms_norm(x.double(), weight.double(), 1e-6)
    assert float((decode.rms_norm(x, weight, 1e-6).double() - expected).abs().max()) < 1e-5
    gate_up = torch.randn(5, 2 * 77, generator=gen) * 4
    expected = reference.silu_mul(gate_up.double())
    assert float((decode.silu_mul(gate_up).double() - expected).abs().max()) < 1e-5 * 16


_SILU_MUL_BITWISE = """
import torch, torch.nn.functional as F
import mcore_rl.ops.decode  # registers the kernels
gen = torch.Generator().manual_seed(3)
for width in (1, 17, 31, 40, 45, 688, 1376, 4864):  # with and without ATen's scalar remainder columns
    gate_up = torch.randn(64, 2 * width, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(torch.ops.mcore_rl.silu_mul(gate_up), F.silu(gate) * up), width
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
@pytest.mark.parametrize("capability", ["this-cpu", "avx2", "default"])
def test_silu_mul_is_bitwise_atens_swiglu(capability) -> None:
    """Prefill and training run the kernel in place of megatron's ``silu(gate) * up``: it must compute ATen's
    numbers column for column, whichever vector width ATen dispatches to (``ATEN_CPU_CAPABILITY``: read once
    per process, so each forced width runs in its own)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != "this-cpu":
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-c", _SILU_MUL_BITWISE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    if capability != "this-cpu":
        assert done.stdout.strip() == capability.upper()


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
def test_opcheck_decode_kernels() -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 8 * 16, generator=gen)
    keys, values = _cache(4, 2, 16, 10, gen)
    torch.library.opcheck(
        torch.ops.mcore_rl.decode_attention.default,
        (qkv, torch.randn(3, 16), torch.randn(3, 16), keys, values, 6, torch.tensor([0, 2, 6]), 4, 0.25),
    )
    panels = decode.pack_panels(torch.randn(12, 20))
    torch.library.opcheck(torch.ops.mcore_rl.decode_linear.default, (torch.randn(5, 12), panels, 20, None))
    torch.library.opcheck(torch.ops.mcore_rl.rms_norm.default, (torch.randn(4, 24), torch.randn(24), 1e-5))
    torch.library.opcheck(torch.ops.mcore_rl.silu_mul.default, (torch.randn(4, 24),))


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
def test_decode_kernels_reject_bad_input() -> None:
    keys, values = _cache(2, 2, 8, 6, torch.Generator().manual_seed(3))
    qkv = torch.randn(2, 6 * 8)
    with pytest.raises(RuntimeError, match="column"):
        torch.ops.mcore_rl.decode_attention(
            qkv, torch.ones(1, 8), torch.zeros(1, 8), keys, values, 6, None, 2, 1.0
        )
    with pytest.raises(RuntimeError, match="start"):
        torch.ops.mcore_rl.decode_attention(
            qkv, torch.ones(1, 8), torch.zeros(1, 8), keys, values, 3, torch.tensor([0, 4]), 2, 1.0
        )
    with pytest.raises(RuntimeError, match="qkv"):
        torch.ops.mcore_rl.decode_attention(
            qkv[:, :40].contiguous(), torch.ones(1, 8), torch.zeros(1, 8), keys, values, 1, None, 2, 1.0
        )
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.mcore_rl.decode_linear(torch.randn(2, 12), torch.randn(1, 12, 16), 20, None)
    with pytest.raises(RuntimeError, match="add"):
        torch.ops.mcore_rl.decode_linear(torch.randn(2, 12), torch.randn(1, 12, 16), 16, torch.randn(3, 16))
