"""The rollout decoder's projections: ``x @ weight_t`` with the packed forms decode steps run on (CPU, fp32).

A decode step multiplies a few rows (one token per sequence) by every weight. ATen's GEMM re-packs the weight
inside each call, which at those sizes costs about a third of the call. So a decode step runs on a packed
copy made once: our AVX2 column-panel kernel where that beats MKL (:func:`panels_pay`), else MKL's own packed
GEMM (``ops.decode.mkl_pack``), packed for the batch size (``RolloutDecoder._pack_for``). Multi-token
forwards (prefill, recompute) run ATen's GEMM, bitwise what megatron computes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mcore_rl.ops import decode as fused


class Projection(NamedTuple):
    """``x @ weight_t``: the contiguous [in, out] storage under an [out, in] weight (one plain GEMM call), and
    on CPU in fp32 the same matrix packed for decode steps: into column panels (``ops.decode.decode_linear``)
    where those pay, else as MKL's packed GEMM operand for the current batch size (``mkl``: [rows, packed]
    once packed, see ``RolloutDecoder._pack_for``)."""

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
    has it. Measured at the rollout's shapes (hidden 256, one thread): with AVX-512, MKL does 1.0-1.1x the
    kernel's FLOP/s at 1-4 rows and 1.5-2x at 16-128; capped at AVX2 (``MKL_ENABLE_INSTRUCTIONS=AVX2``) the
    kernel is 1.1-1.2x faster at 4-8 rows and level beyond. So panels (and the second copy of the weights
    they cost) only where ATen itself runs without AVX-512.
    """
    if not fused.packing_enabled(device, dtype):
        return False
    return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def linear(x: Tensor, proj: Projection, add: Tensor | None, decoding: bool) -> Tensor:
    """``add + x @ weight_t``: a decode step's few rows run on a packed weight where there is one (our
    small-batch panel kernel or MKL's packed GEMM); everything else ATen's GEMM, bitwise what megatron
    computes."""
    packed = proj.decode_packed(x.shape[0]) if decoding else None
    if packed is not None and proj.panels is not None:
        return fused.decode_linear(x, proj.panels, proj.weight_t.shape[1], add)
    if packed is not None and proj.mkl:
        return fused.mkl_linear(x, packed, proj.weight_t, add, rows=proj.mkl[0])
    return torch.mm(x, proj.weight_t) if add is None else torch.addmm(add, x, proj.weight_t)
