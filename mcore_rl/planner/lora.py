"""LoRA in the memory plan (``engine/lora.py``): the adapters one training rank holds, and what they change.

Each adapted HF projection of a decoder layer adds ``A [r, in]`` and ``B [out, r]``; TP splits them as the
engine does (a column-parallel base, ``q/k/v_proj`` and ``gate/up_proj``: A whole, B by output rows; a
row-parallel base, ``o_proj`` and ``down_proj``: A by input columns, B whole)::

    q_proj      r h + (heads d) r / t          o_proj      r (heads d) / t + h r
    k_proj      r h + (kv d) r / t             gate_proj   r h + f r / t      (up_proj the same)
    v_proj      r h + (kv d) r / t             down_proj   r f / t + h r

With LoRA the base is frozen: the rank holds the base's weights plus the adapters (training dtype), and
gradients (fp32) and optimizer state (12 B/param in bf16, 8 in fp32, sharded over DP) for the adapters only.
The reference policy is the base with the adapters switched off: no weights of its own. The weight sync
sends the adapted weights merged, ``W + scale B A``, each a new tensor of the base's shard: during the switch
the rank holds a merged copy of every megatron linear that carries an adapter (the whole fused QKV or
[gate; up] even when only some of its projections are adapted).
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.lora_spec import SEGMENTS, TARGETS
from mcore_rl.parallel.layout import ParallelLayout


def projection_adapter_params(arch: ModelArch, projection: str, rank: int, tp: int = 1) -> int:
    """A and B of one HF projection's adapter on one TP rank."""
    hidden, ffn = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    column = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": ffn, "up_proj": ffn}  # out rows, split
    row = {"o_proj": q, "down_proj": ffn}  # in columns, split
    if projection in column:
        return rank * hidden + column[projection] * rank // tp
    if projection in row:
        return rank * row[projection] // tp + hidden * rank
    raise ValueError(f"{projection!r} is not one of {list(TARGETS)}")


def layer_adapter_params(arch: ModelArch, rank: int, targets: Sequence[str], tp: int = 1) -> int:
    """Every adapter of one decoder layer on one TP rank."""
    return sum(projection_adapter_params(arch, p, rank, tp) for p in targets)


def stage_adapter_params(
    arch: ModelArch, layout: ParallelLayout, stage: int, rank: int, targets: Sequence[str]
) -> int:
    """The adapters one rank of pipeline stage ``stage`` holds (all its virtual chunks)."""
    layers = sum(len(chunk) for chunk in layout.stage_layers(arch.num_layers)[stage])
    return layers * layer_adapter_params(arch, rank, targets, layout.tp)


def model_adapter_params(arch: ModelArch, rank: int, targets: Sequence[str]) -> int:
    """The whole model's adapter parameters (what a PEFT adapter file holds)."""
    return arch.num_layers * layer_adapter_params(arch, rank, targets)


def stage_merged_params(arch: ModelArch, layout: ParallelLayout, stage: int, targets: Sequence[str]) -> int:
    """Base weights one rank of ``stage`` sends merged: every megatron linear with an adapter, whole."""
    hidden, ffn, tp = arch.hidden_size, arch.ffn_hidden_size, layout.tp
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    sizes = {
        "self_attention.linear_qkv": (q + 2 * kv) * hidden // tp,
        "self_attention.linear_proj": hidden * q // tp,
        "mlp.linear_fc1": 2 * ffn * hidden // tp,
        "mlp.linear_fc2": hidden * ffn // tp,
    }
    per_layer = sum(size for module, size in sizes.items() if set(SEGMENTS[module]) & set(targets))
    layers = sum(len(chunk) for chunk in layout.stage_layers(arch.num_layers)[stage])
    return layers * per_layer
