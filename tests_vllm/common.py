"""Shared pieces of the vLLM contract tests: the tiny configs written where vLLM can read them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.vllm_engine import VLLMRolloutConfig, engine_args
from tests.models import tiny_arch

CASES = {
    "llama": dict(hidden_size=128, num_key_value_heads=4),  # untied; kv 4 so that TP 4 splits whole KV heads
    "qwen2": dict(hidden_size=128, num_key_value_heads=4),  # tied, with a qkv bias
    # q/k norms, head_dim 32 apart from hidden / heads = 16
    "qwen3": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    # 4 experts of 32 (8 a rank at TP 4), layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32),
    "mixtral": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4),  # 4 experts of 48
}
"""Tiny configs of every layout (head_dim 32, the smallest vLLM's CPU attention takes; hidden 128, a multiple
of the CPU fused-MoE kernel's 32); each splits at TP 1, 2 and 4."""

CONFIG = VLLMRolloutConfig(dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=16 << 20)


def arch_of(family: str) -> ModelArch:
    return tiny_arch(family, **CASES[family])


def write_config(arch: ModelArch, directory: Path) -> str:
    """config.json of ``arch`` in ``directory`` (what VLLMRolloutEngine writes), returned as the model path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(arch.extra))
    return str(directory)


def our_engine_args(model: str, tp: int, **overrides: Any) -> dict[str, Any]:
    """The arguments VLLMRolloutEngine passes to ``vllm.LLM`` on this platform for the tiny configs."""
    return engine_args(model, replace(CONFIG, **overrides), tp)
