"""vLLM resolves its platform once, on first use: this machine has no GPU, so take vLLM's CPU platform (the
config validation runs there; the one CUDA-only check, sleep mode, is asked of vLLM's platform rules)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
