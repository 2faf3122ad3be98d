"""Shared pieces of the vLLM contract tests: the tiny configs written where vLLM can read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.vllm_engine import engine_args
from tests.models import tiny_arch

CASES = {
    "llama": dict(num_key_value_heads=4),  # untied; kv 4 so that TP 4 splits whole KV heads
    "qwen2": dict(num_key_value_heads=4),  # tied, with a qkv bias
}
"""Tiny configs of both layouts; every one splits at TP 1, 2 and 4."""


def arch_of(family: str) -> ModelArch:
    return tiny_arch(family, **CASES[family])


def write_config(arch: ModelArch, directory: Path) -> str:
    """config.json of ``arch`` in ``directory`` (what VLLMRolloutEngine writes), returned as the model path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(arch.extra))
    return str(directory)


def our_engine_args(model: str, tp: int, **overrides: Any) -> dict[str, Any]:
    """The arguments VLLMRolloutEngine passes to ``vllm.LLM`` for the tiny configs."""
    args = dict(
        tensor_parallel_size=tp,
        dtype=torch.float32,
        max_model_len=64,
        gpu_memory_utilization=0.5,
        seed=0,
        enforce_eager=True,
    )
    args.update(overrides)
    return engine_args(model, **args)
