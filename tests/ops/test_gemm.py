"""``ops.gemm``: the oneDNN fp32 GEMM op against fp64, for every operand layout the rollout and the trainer
pass, and the rule that picks it over ATen's GEMM."""

from __future__ import annotations

import functools

import pytest
import torch

from mcore_rl.ops import _native, gemm

needs_op = pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
needs_onednn = pytest.mark.skipif(
    not gemm.onednn_available(),
    # torch's oneDNN matmul refuses CPUs without AVX-512 (or AVX-NE-CONVERT), fp32 included; the op's
    # callers then keep ATen's GEMM (gemm.onednn_pays is False: test_onednn_runs_only_where_it_pays)
    reason="torch's oneDNN matmul does not run on this CPU",
)


def _operands(m: int, k: int, n: int, layout: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """a [m, k] and b [k, n]: contiguous, or transposed views of contiguous storage (the trainer's weight
    [n, k] read as b, a backward's grad_output^T read as a)."""
    a = torch.randn(k, m, generator=gen).t() if layout[0] == "t" else torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).t() if layout[1] == "t" else torch.randn(k, n, generator=gen)
    return a, b


@needs_onednn
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m, k, n", [(1, 7, 5), (37, 64, 100), (256, 96, 48)])
@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_gemm_op_matches_fp64(layout, m, k, n, add) -> None:
    gen = torch.Generator().manual_seed(m + k + n)
    a, b = _operands(m, k, n, layout, gen)
    extra = {
        "none": None,
        "bias": torch.randn(n, generator=gen),
        "residual": torch.randn(m, n, generator=gen),
    }[add]
    kept = None if extra is None else extra.clone()
    out = torch.ops.mcore_rl.gemm(a, b, extra)
    expected = a.double() @ b.double() + (0 if extra is None else extra.double())
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert float((out.double() - expected).abs().max()) < 1e-5 * k**0.5
    if extra is not None:
        assert torch.equal(extra, kept)  # the addend is read, never written


@needs_op
def test_gemm_op_checks() -> None:
    with pytest.raises(RuntimeError, match="a \\[M, K\\] and b \\[K, N\\]"):
        torch.ops.mcore_rl.gemm(torch.randn(2, 3), torch.randn(4, 2), None)
    with pytest.raises(RuntimeError, match="add must be"):
        torch.ops.mcore_rl.gemm(torch.randn(2, 3), torch.randn(3, 2), torch.randn(3))
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.mcore_rl.gemm(torch.randn(2, 3).double(), torch.randn(3, 2).double(), None)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.mcore_rl.gemm_into(torch.randn(20, 5).t(), torch.randn(5, 12), torch.randn(12, 20), 0.0)


@needs_onednn
def test_gemm_ops_pass_opcheck() -> None:
    torch.library.opcheck(torch.ops.mcore_rl.gemm.default, (torch.randn(5, 12), torch.randn(12, 20), None))
    torch.library.opcheck(
        torch.ops.mcore_rl.gemm.default, (torch.randn(5, 12), torch.randn(20, 12).t(), torch.randn(20))
    )
    torch.library.opcheck(
        torch.ops.mcore_rl.gemm_into.default,
        (torch.randn(5, 20), torch.randn(5, 12), torch.randn(12, 20), 1.0),
    )


@needs_op
@pytest.mark.parametrize(("m", "k", "n"), [(3, 0, 5), (0, 4, 5), (3, 4, 0)])
def test_empty_shapes_give_the_empty_product(m: int, k: int, n: int) -> None:
    """K = 0 left the output unwritten (garbage where zeros belong); M = 0 with an addend faulted in oneDNN."""
    a, b, add = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    assert torch.equal(torch.ops.mcore_rl.gemm(a, b, None), torch.zeros(m, n))
    assert torch.equal(torch.ops.mcore_rl.gemm(a, b, add), add.expand(m, n))
    out = torch.full((m, n), 7.0)
    torch.ops.mcore_rl.gemm_into(out, a, b, 1.0)
    assert torch.equal(out, torch.full((m, n), 7.0))
    torch.ops.mcore_rl.gemm_into(out, a, b, 0.0)
    assert torch.equal(out, torch.zeros(m, n))


def test_onednn_runs_only_where_it_pays(monkeypatch) -> None:
    cpu = torch.device("cpu")
    # the host check is cached: a fresh cache of its own, cleared under each patched vendor below
    monkeypatch.setattr(gemm, "_host_prefers_onednn", functools.cache(gemm._host_prefers_onednn.__wrapped__))
    assert not gemm.onednn_pays(torch.device("meta"), torch.float32)
    assert not gemm.onednn_pays(cpu, torch.bfloat16)
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "GenuineIntel")  # MKL runs AVX-512 there
    gemm._host_prefers_onednn.cache_clear()
    assert not gemm.onednn_pays(cpu, torch.float32)
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    gemm._host_prefers_onednn.cache_clear()
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert gemm.onednn_pays(cpu, torch.float32) == (avx512 and _native.native_available())
    monkeypatch.setenv("MCORE_RL_GEMM", "aten")
    assert not gemm.onednn_pays(cpu, torch.float32)


@pytest.mark.parametrize("choice", ["auto", "aten"])
def test_gemm_is_add_plus_product_on_either_library(choice, monkeypatch) -> None:
    if choice == "aten":
        monkeypatch.setenv("MCORE_RL_GEMM", "aten")
    gen = torch.Generator().manual_seed(3)
    a, b = _operands(160, 128, 120, "nt", gen)  # above MIN_ONEDNN_MACS: oneDNN where it pays
    bias = torch.randn(120, generator=gen)
    expected = a.double() @ b.double() + bias.double()
    assert float((gemm.gemm(a, b, bias).double() - expected).abs().max()) < 1e-4
    assert float((gemm.gemm(a, b).double() - (a.double() @ b.double())).abs().max()) < 1e-4


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("choice", ["auto", "aten"])
def test_gemm_into_writes_or_accumulates_in_place(accumulate, choice, monkeypatch) -> None:
    if choice == "aten":
        monkeypatch.setenv("MCORE_RL_GEMM", "aten")
    gen = torch.Generator().manual_seed(4)
    a, b = _operands(150, 130, 121, "tn", gen)  # a weight gradient's grad_output^T @ input
    out = torch.randn(150, 121, generator=gen)
    before, storage = out.clone(), out.data_ptr()
    gemm.gemm_into(out, a, b, accumulate)
    expected = a.double() @ b.double() + (before.double() if accumulate else 0)
    assert out.data_ptr() == storage and float((out.double() - expected).abs().max()) < 1e-4


def test_a_row_of_the_product_depends_on_that_row_only() -> None:
    """What keeps the rollout's recompute bitwise the trainer's when both run ``ops.gemm``: a row's result is
    the same whatever the other rows, their order and count, and the weight's layout (the trainer reads
    megatron's [N, K] weight transposed, the rollout a contiguous [K, N] copy); and products below
    ``MIN_ONEDNN_MACS`` stay ATen's."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(96, 256, generator=gen), torch.randn(200, 256, generator=gen)
    full = gemm.gemm(x, weight.t())
    order = torch.randperm(96, generator=gen)
    assert torch.equal(gemm.gemm(x, weight.t().contiguous()), full)
    assert torch.equal(gemm.gemm(x[order].contiguous(), weight.t())[torch.argsort(order)], full)
    assert torch.equal(gemm.gemm(x[:48].contiguous(), weight.t()), full[:48])  # 2.4M MACs: still oneDNN
    small_x, small_w = torch.randn(4, 32, generator=gen), torch.randn(16, 32, generator=gen)
    assert torch.equal(gemm.gemm(small_x, small_w.t()), torch.mm(small_x, small_w.t()))
