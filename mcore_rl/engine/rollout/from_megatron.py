"""Megatron-layout rollout shards (what the reshard executor produces) -> the rollout engine's tensors.

The executor delivers, per rank, megatron's shard of each full tensor for the rollout TP degree. Only
``linear_qkv`` needs re-ordering: megatron interleaves ``[q heads; k; v]`` per query group, while the
rollout layout (and vLLM's ``QKVParallelLinear``) holds ``[q; k; v]`` for the rank's groups. Everything
else is a rename: gate/up already sit as ``[gate_shard; up_shard]`` and vocab shards keep their padding.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import Tensor

from mcore_rl.engine.arch import ModelArch

_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",  # MoE
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def deinterleave_qkv(shard: Tensor, arch: ModelArch) -> Tensor:
    """[groups_local * (heads_per_group + 2) * head_dim, ...] per-group rows -> [q; k; v] rows."""
    per_group, hd = arch.num_attention_heads // arch.num_query_groups, arch.head_dim
    grouped = shard.reshape(-1, (per_group + 2) * hd, *shard.shape[1:])
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])


def rollout_tensors(shards: dict[str, Tensor], arch: ModelArch) -> Iterator[tuple[str, Tensor]]:
    """``(rollout name, tensor)`` pairs, streamed so the engine can load them one at a time."""
    for name, tensor in shards.items():
        if name == "embedding.word_embeddings.weight":
            yield "embed_tokens.weight", tensor
        elif name == "output_layer.weight":
            yield "lm_head.weight", tensor
        elif name == "decoder.final_layernorm.weight":
            yield "norm.weight", tensor
        else:
            _, _, index, rest = name.split(".", 3)  # decoder.layers.{i}.{rest}
            if rest.startswith("self_attention.linear_qkv."):
                yield (
                    f"layers.{index}.self_attn.qkv_proj.{rest.rsplit('.', 1)[1]}",
                    deinterleave_qkv(tensor, arch),
                )
            elif expert := _EXPERT.match(rest):  # MoE: per-expert names of the rollout layout
                kind = "gate_up_proj" if expert.group(2) == "1" else "down_proj"
                yield f"layers.{index}.mlp.experts.{expert.group(1)}.{kind}.weight", tensor
            else:
                yield f"layers.{index}.{_RENAMES[rest]}", tensor
