"""``add + a @ b`` in fp32 on the faster of the CPU's two GEMM libraries: ATen's (MKL's sgemm) or oneDNN's.

MKL chooses its kernels by CPU vendor: on an AMD CPU with AVX-512 it runs its AVX2 code, while oneDNN, which
torch also carries, runs AVX-512 there. Measured 2026-12-06 on an AMD EPYC (Zen 5, two threads), fp32,
oneDNN over ATen: [1024, 512] x [512, 2752] 471 vs 200 GFLOP/s, x [512, 32000] 299 vs 169, [4096, 512] x
[512, 768] 491 vs 227, [1024, 1376] x [1376, 512] 484 vs 212. On Intel CPUs MKL runs its AVX-512 code and stays
ATen's GEMM. torch routes fp32 products to oneDNN only when reduced precision (bf32 / tf32) is allowed; the
``mcore_rl::gemm`` op (``csrc/gemm_cpu.cpp``) calls it in full fp32. :func:`onednn_pays` says where; both
libraries are exact fp32 GEMMs, with their own order of summation (they differ by fp32 rounding).

``MCORE_RL_GEMM=aten`` keeps ATen's GEMM everywhere (read per call, as ``MCORE_RL_DECODE_ISA``), to compare.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from mcore_rl.io.host import cpu_vendor
from mcore_rl.ops import _native


def onednn_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fp32 GEMMs on ``device`` run faster on oneDNN than on ATen: CPU, fp32, the compiled op present
    and working, ATen at AVX-512 on a CPU that is not Intel's (where MKL would stay on AVX2)."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get("MCORE_RL_GEMM") == "aten":
        return False
    return _native.native_available() and _host_prefers_onednn()


@functools.cache
def _host_prefers_onednn() -> bool:
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return avx512 and cpu_vendor() not in ("GenuineIntel", "") and _onednn_works()


def onednn_available() -> bool:
    """Whether the oneDNN op runs here at all (compiled in, the symbol exported, fp32 accepted), whether or
    not it pays; benchmarks time it beside ATen's GEMM."""
    return _native.native_available() and _onednn_works()


@functools.cache
def _onednn_works() -> bool:
    """The op is compiled in and this torch exports the oneDNN matmul it calls, in fp32 (tried once)."""
    if not _native.extension_loaded():
        return False
    try:
        out = torch.ops.mcore_rl.gemm(torch.ones(2, 3), torch.ones(3, 2), torch.ones(2))
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((2, 2), 4.0)))


# oneDNN's call costs 10-15 us more than MKL's (median, this AMD EPYC, 2 threads): below about 2M multiply-adds
# ATen's GEMM is the faster one ([8, 256] x [256, 768]: 37 against 44 us; [64, 64] x [64, 192]: 11 against 19),
# above it oneDNN ([8, 512] x [512, 768]: 64 against 43 us; [256, 64] x [64, 192]: 34 against 28).
MIN_ONEDNN_MACS = 1 << 21


def _routed(a: Tensor, b: Tensor) -> bool:
    return (
        b.dtype == a.dtype
        and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_ONEDNN_MACS
        and onednn_pays(a.device, a.dtype)
    )


def gemm(a: Tensor, b: Tensor, add: Tensor | None = None) -> Tensor:
    """``add + a @ b`` for ``a`` [M, K], ``b`` [K, N] (any strides), ``add`` None, a bias [N] or [M, N]: on
    oneDNN where :func:`onednn_pays` and the product is large enough to repay its call (``MIN_ONEDNN_MACS``),
    else ATen's ``mm`` / ``addmm``."""
    if _routed(a, b) and (add is None or add.dtype == a.dtype):
        return torch.ops.mcore_rl.gemm(a, b, add)
    return torch.mm(a, b) if add is None else torch.addmm(add, a, b)


def gemm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) in place, ``out`` a contiguous [M, N]; on oneDNN as
    :func:`gemm` chooses, else ATen's ``mm(out=)`` / ``addmm_``."""
    if _routed(a, b) and out.dtype == a.dtype and out.is_contiguous():
        torch.ops.mcore_rl.gemm_into(out, a, b, 1.0 if accumulate else 0.0)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


if _native.extension_loaded():

    @torch.library.register_fake("mcore_rl::gemm")
    def _(a: Tensor, b: Tensor, add: Tensor | None) -> Tensor:
        return a.new_empty(a.shape[0], b.shape[1])

    @torch.library.register_fake("mcore_rl::gemm_into")
    def _(out: Tensor, a: Tensor, b: Tensor, beta: float) -> None:
        return None
