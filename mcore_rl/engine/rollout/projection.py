"""The rollout decoder's projections: ``x @ weight_t`` with the packed forms decode steps run on (CPU, fp32).

A decode step multiplies a few rows (one token per sequence) by every weight. ATen's GEMM re-packs the weight
inside each call, which at those sizes costs about a third of the call. So a decode step runs on a packed
copy made once: our column-panel kernels (AVX2, and AVX-512 where the CPU has it) where those beat MKL
(:func:`panels_pay`: all but Intel CPUs with AVX-512), else MKL's own packed GEMM (``ops.decode.mkl_pack``),
packed for the batch size (:class:`DecodePacking`). Multi-token forwards (prefill, recompute) run
``ops.gemm``: oneDNN on CPUs where MKL lacks its AVX-512 code, else ATen's GEMM, as the trainer's linears do
(``compat/megatron_cpu.py`` routes megatron's products there), so the recompute stays bitwise megatron's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from mcore_rl.io.host import cpu_vendor
from mcore_rl.ops import decode as fused
from mcore_rl.ops.gemm import gemm


class Projection(NamedTuple):
    """``x @ weight_t``: the contiguous [in, out] storage under an [out, in] weight (one plain GEMM call), and
    on CPU in fp32 the same matrix packed for decode steps: into column panels (``ops.decode.decode_linear``)
    where those pay, else as MKL's packed GEMM operand for the current batch size (``mkl``: [rows, packed]
    once packed, see :class:`DecodePacking`)."""

    weight_t: Tensor
    panels: Tensor | None
    mkl: list | None = None

    def decode_packed(self, rows: int) -> Tensor | None:
        """The packed form a decode step of ``rows`` rows uses, if any."""
        if self.panels is not None:
            return self.panels
        return self.mkl[1] if self.mkl and serves(self.mkl[0], rows) else None


def serves(packed_rows: int, rows: int) -> bool:
    """Whether weights MKL-packed for ``packed_rows`` rows run a decode step of ``rows``, zero-padded."""
    return rows <= packed_rows <= 2 * rows


def panels_pay(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode-step projections run on packed panels rather than MKL's GEMM.

    The panel kernel is built for AVX2; MKL repacks the weight on every call but runs AVX-512 where the CPU
    has it and is Intel's. Measured at the rollout's shapes on an Intel CPU with AVX-512 (hidden 256, one
    thread): MKL does 1.0-1.1x the kernel's FLOP/s at 1-4 rows and 1.5-2x at 16-128; capped at AVX2
    (``MKL_ENABLE_INSTRUCTIONS=AVX2``) the kernel is 1.1-1.2x faster at 4-8 rows and level beyond. On an AMD
    EPYC with AVX-512 (2026-12-06, ``bench/bench_decode_projections.py``) MKL's packed and plain GEMMs run
    far below their Intel form and the panels win at every shape: a layer's projections and the LM head at
    16-32 rows 1.2-1.5x faster on one thread, 1.4-2.3x on two (hidden 256 to Qwen2.5-0.5B's 896). So panels
    (and the second copy of the weights they cost) everywhere but where ATen runs AVX-512 on an Intel CPU.
    Since then the panels have an AVX-512 kernel of their own, run wherever the CPU has AVX-512F: on the AMD
    EPYC 1.6-2.1x the AVX2 kernel's speed on two threads at 8-128 rows. The Intel measurement above predates
    it and is the one to repeat there before Intel's AVX-512 CPUs move onto the panels too.
    """
    if not fused.packing_enabled(device, dtype):
        return False
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return not (avx512 and cpu_vendor() == "GenuineIntel")


def linear(x: Tensor, proj: Projection, add: Tensor | None, decoding: bool) -> Tensor:
    """``add + x @ weight_t``: a decode step's few rows run on a packed weight where there is one (our panel
    kernels or MKL's packed GEMM); everything else (prefill, recompute) on ``ops.gemm``, the GEMM the trainer's
    linears run on this CPU (see the module docstring), bitwise what megatron computes."""
    packed = proj.decode_packed(x.shape[0]) if decoding else None
    if packed is not None and proj.panels is not None:
        return fused.decode_linear(x, proj.panels, proj.weight_t.shape[1], add)
    if packed is not None and proj.mkl:
        return fused.mkl_linear(x, packed, proj.weight_t, add, rows=proj.mkl[0])
    return gemm(x, proj.weight_t, add)


class DecodePacking:
    """When a decoder's decode steps pack their projections (MKL) and for how many rows: packed at a
    generation's first decode step (:meth:`start`), then kept while finished sequences shrink the batch to no
    less than half the packed rows (the few rows run zero-padded, far cheaper than packing again); a smaller
    batch is packed for once its size repeats. A new instance (weights loaded or moved) has packed nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.rows = 0  # rows the projections are packed for (0: none)
        self._last = 0  # the previous decode step's rows

    def start(self, rows: int, projections: list[Projection]) -> bool:
        """A generation of ``rows`` rows starts: keep a packing for exactly that many, else forget it (packed
        again at the first step). -> whether the packed forms changed."""
        self._last = 0
        if self.rows == rows:
            return False
        for proj in projections:
            if proj.mkl is not None:
                proj.mkl.clear()
        self.rows = 0
        return True

    def pack_for(self, rows: int, projections: Callable[[], list[Projection]]) -> bool:
        """Before a decode step of ``rows`` rows. -> whether it packed (the packed forms changed)."""
        repeat, self._last = rows == self._last, rows
        if not self.enabled or serves(self.rows, rows) or not (repeat or self.rows == 0):
            return False
        for proj in projections():
            if proj.mkl is not None:  # None: a vocab shard of padding only
                proj.mkl[:] = [rows, fused.mkl_pack(proj.weight_t, rows)]
        self.rows = rows
        return True

    def rows_for(self, rows: int) -> int:
        """The packed row count a decode step of ``rows`` rows runs zero-padded to (0: it runs unpacked)."""
        return self.rows if serves(self.rows, rows) else 0
