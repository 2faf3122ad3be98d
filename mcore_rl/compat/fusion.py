"""Which optional GPU kernels megatron-core may use here: Transformer Engine and the fused masked softmax.

Both switches are decided by what actually imports, not by ``torch.cuda.is_available()`` alone:

- ``masked_softmax_fusion``: megatron-core 0.16.1's ``FusedScaleMaskSoftmax`` imports the compiled modules
  below on the first fp16/bf16 forward with a kernel-friendly shape (``fusions/fused_softmax.py``,
  ``is_kernel_available`` -> ``get_batch_per_block``). The megatron-core wheel does not ship them (they come
  from Megatron-LM's legacy fused kernels or apex), so turning the fusion on because CUDA exists fails with
  ``ModuleNotFoundError`` on that forward. TE brings its own fused softmax, so TE alone also allows it.
- Transformer Engine: TE's top-level ``__init__`` swallows a failed ``from . import pytorch`` (a missing or
  ABI-mismatched extension), so ``import transformer_engine`` can succeed while megatron's TE spec then
  fails with ``NameError: TESpecProvider``. We import ``transformer_engine.pytorch`` itself and require
  megatron's own ``HAVE_TE`` flag.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

MASKED_SOFTMAX_MODULES = (
    "scaled_masked_softmax_cuda",
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda",
)
"""The compiled modules megatron-core's fused softmax imports (one per mask kind)."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module with no spec
        return False


def transformer_engine_available() -> bool:
    """TE's PyTorch extension imports and megatron-core accepted it (a CUDA device is present)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
        specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    except Exception:  # TE raises assorted errors (OSError, RuntimeError) when its CUDA libraries are missing
        return False
    return bool(getattr(specs, "HAVE_TE", False))


def masked_softmax_fusion_available(use_transformer_engine: bool) -> bool:
    """Whether megatron's ``masked_softmax_fusion`` can be on: CUDA and (TE, or every compiled kernel)."""
    if not torch.cuda.is_available():
        return False
    return use_transformer_engine or all(_importable(m) for m in MASKED_SOFTMAX_MODULES)
