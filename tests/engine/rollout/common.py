"""Shared helpers of the rollout tests: random megatron full states and engines loaded from them."""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import LocalRolloutConfig, LocalRolloutEngine, rollout_shards_from_full


def random_full_state(
    arch: ModelArch, seed: int = 0, std: float = 0.12, embedding_std: float = 0.3
) -> dict[str, torch.Tensor]:
    """A megatron full state (TP1, real vocab rows; see mcore_rl/engine/weights.py) with random values.

    The scales give logits of std ~1 (Llama) to ~2.5 (Qwen2's tied head): distributions far from uniform,
    yet the fp32 rounding noise of any two ways of computing them stays well below 1e-5 in log-prob. Norm
    weights and biases are random too, so a swapped or misplaced tensor shows in the logits.
    """
    g = torch.Generator().manual_seed(seed)
    hidden, hd = arch.hidden_size, arch.head_dim

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * hd
    full = {
        "embedding.word_embeddings.weight": rand(arch.vocab_size, hidden, scale=embedding_std),
        "decoder.final_layernorm.weight": 1 + rand(hidden),
    }
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        full[p + "input_layernorm.weight"] = 1 + rand(hidden)
        full[p + "self_attention.linear_qkv.weight"] = rand(qkv_rows, hidden)
        if arch.qkv_bias:
            full[p + "self_attention.linear_qkv.bias"] = rand(qkv_rows)
        if arch.qk_norm:  # Qwen3's per-head norms over head_dim
            full[p + "self_attention.q_layernorm.weight"] = 1 + rand(hd)
            full[p + "self_attention.k_layernorm.weight"] = 1 + rand(hd)
        full[p + "self_attention.linear_proj.weight"] = rand(hidden, arch.num_attention_heads * hd)
        full[p + "pre_mlp_layernorm.weight"] = 1 + rand(hidden)
        if arch.moe is not None and arch.is_moe_layer(i):  # router logits of std ~1: decisive top-k choices
            full[p + "mlp.router.weight"] = rand(arch.moe.num_experts, hidden, scale=1.0)
            f = arch.moe.ffn_hidden_size
            for e in range(arch.moe.num_experts):
                expert = f"{p}mlp.experts.local_experts.{e}."
                full[expert + "linear_fc1.weight"] = rand(2 * f, hidden)
                full[expert + "linear_fc2.weight"] = rand(hidden, f)
            continue
        full[p + "mlp.linear_fc1.weight"] = rand(2 * arch.ffn_hidden_size, hidden)
        full[p + "mlp.linear_fc2.weight"] = rand(hidden, arch.ffn_hidden_size)
    if not arch.tie_word_embeddings:
        full["output_layer.weight"] = rand(arch.vocab_size, hidden)
    return full


def make_engine(
    arch: ModelArch,
    full: dict[str, torch.Tensor],
    tp_group: torch.distributed.ProcessGroup | None = None,
    **config: Any,
) -> LocalRolloutEngine:
    engine = LocalRolloutEngine(arch, LocalRolloutConfig(**config), tp_group=tp_group)
    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    engine.load_weights(rollout_shards_from_full(full, arch, tp, rank).items())
    return engine


def recomputed_log_probs(
    engine: LocalRolloutEngine, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` from one no-cache forward over the whole sequence [R]."""
    tokens = torch.tensor([prompt + response])
    logits = engine.decoder.full_logits(tokens)[0, len(prompt) - 1 : -1]
    z = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(z, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
