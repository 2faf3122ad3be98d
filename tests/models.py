"""Tiny model configurations for tests (HF-style config dicts; no hub access)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.train_engine import MicroBatch

_FAMILY_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def tiny_hf_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a 2..4-layer model small enough for CPU tests."""
    cfg: dict[str, Any] = {
        "architectures": [_FAMILY_ARCH[family]],
        "model_type": family,
        "vocab_size": 250,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.05,
    }
    if family == "qwen2":
        cfg["tie_word_embeddings"] = True
    if family == "mistral":
        cfg["sliding_window"] = 8
    if family == "qwen3":  # head_dim independent of hidden / heads (4 x 24 = 96 query rows, hidden 64)
        cfg.update(head_dim=24, attention_bias=False)
    if family == "qwen3_moe":  # 4 experts of 32, top-2 renormalised; layer 1 dense (mlp_only_layers)
        cfg.update(
            head_dim=24,
            attention_bias=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            router_aux_loss_coef=0.001,
        )
    if family == "mixtral":  # 4 experts of intermediate_size 48, top-2, a sliding window as Mistral's
        cfg.update(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    cfg.update(overrides)
    return cfg


def tiny_arch(family: str = "llama", **overrides: Any) -> ModelArch:
    return ModelArch.from_hf_config(tiny_hf_config(family, **overrides))


@dataclass
class LabeledMicroBatch(MicroBatch):
    """A test micro-batch with what the tests' own losses read: next-token labels, the real vocabulary,
    per-token weights or the rows' indices in the whole batch."""

    labels: torch.Tensor | None = None
    vocab_size: int = 0
    weights: torch.Tensor | None = None
    index: torch.Tensor | None = None
