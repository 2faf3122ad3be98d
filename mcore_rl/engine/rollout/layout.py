"""The rollout layout: names and shapes of one rollout TP rank's tensors, and its naive oracle.

Rollout layout (vLLM's, one TP rank)::

    embed_tokens.weight                         [V_pad / tp, hidden]        vocab rows of this rank
    layers.{i}.input_layernorm.weight           [hidden]
    layers.{i}.self_attn.qkv_proj.weight        [(h + 2 kv) * head_dim, hidden], h = heads / tp,
                                                kv = kv_heads / tp, rows [q_shard; k_shard; v_shard]
    layers.{i}.self_attn.qkv_proj.bias          [(h + 2 kv) * head_dim]     (Qwen2 / attention_bias)
    layers.{i}.self_attn.q_norm.weight          [head_dim]                  (Qwen3: RMSNorm of each head,
    layers.{i}.self_attn.k_norm.weight          [head_dim]                  before rotary; replicated)
    layers.{i}.self_attn.o_proj.weight          [hidden, h * head_dim]      row-parallel (all-reduce)
    layers.{i}.post_attention_layernorm.weight  [hidden]
    layers.{i}.mlp.gate_up_proj.weight          [2 * ffn / tp, hidden]      rows [gate_shard; up_shard]
    layers.{i}.mlp.down_proj.weight             [hidden, ffn / tp]          row-parallel (all-reduce)
    norm.weight                                 [hidden]
    lm_head.weight                              [V_pad / tp, hidden]        absent when embeddings are tied

``V_pad = padded_vocab_size(vocab, tp, 128)``; padding rows are never real tokens and their logits are
dropped after the all-gather. KV heads are split, never replicated, so ``kv_heads % tp == 0``.

A mixture-of-experts layer (Qwen3-MoE, Mixtral) has, instead of the MLP's two projections, its router and
every expert, each expert split over the rollout TP like a dense MLP (no expert parallelism in the rollout,
as vLLM without EP; the decoder stacks them into vLLM's fused ``w13``/``w2`` layout)::

    layers.{i}.mlp.gate.weight                          [experts, hidden]       the router (replicated)
    layers.{i}.mlp.experts.{e}.gate_up_proj.weight      [2 * moe_ffn / tp, hidden]  rows [gate; up]
    layers.{i}.mlp.experts.{e}.down_proj.weight         [hidden, moe_ffn / tp]
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.from_megatron import deinterleave_qkv
from mcore_rl.io.errors import InputError
from mcore_rl.parallel.layout import padded_vocab_size

VOCAB_DIVISIBLE_BY = 128
"""Vocab padding granularity (times TP), megatron's default, so both sides pad alike."""


class RolloutLayoutError(InputError):
    """The model cannot be split for this rollout TP size; the message names the field."""


def check_rollout_tp(arch: ModelArch, tp: int) -> None:
    sizes = [
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_query_groups),
        ("intermediate_size", arch.ffn_hidden_size),
    ]
    if arch.moe is not None:
        sizes.append(("moe_intermediate_size", arch.moe.ffn_hidden_size))
    for name, value in sizes:
        if value % tp:
            raise RolloutLayoutError(
                f"{name}={value} is not divisible by the rollout tensor_model_parallel_size={tp}"
            )


def rollout_param_shapes(arch: ModelArch, tp: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one rank's tensors in the rollout layout (see the module docstring)."""
    check_rollout_tp(arch, tp)
    hidden, hd = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) // tp * hd
    vocab_rows = padded_vocab_size(arch.vocab_size, tp, VOCAB_DIVISIBLE_BY) // tp
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab_rows, hidden)}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.qkv_proj.weight"] = (qkv_rows, hidden)
        if arch.qkv_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, arch.num_attention_heads // tp * hd)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if arch.moe is not None and arch.is_moe_layer(i):
            shapes[p + "mlp.gate.weight"] = (arch.moe.num_experts, hidden)
            for e in range(arch.moe.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_up_proj.weight"] = (
                    2 * arch.moe.ffn_hidden_size // tp,
                    hidden,
                )
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, arch.moe.ffn_hidden_size // tp)
            continue
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * arch.ffn_hidden_size // tp, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, arch.ffn_hidden_size // tp)
    shapes["norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_rows, hidden)
    return shapes


def _vocab_shard(full: Tensor, arch: ModelArch, tp: int, rank: int, divisible_by: int) -> Tensor:
    rows = padded_vocab_size(arch.vocab_size, tp, divisible_by)
    if full.shape[0] < arch.vocab_size:  # the padding follows the real rows: never in place of them
        raise ValueError(f"a vocab tensor of {full.shape[0]} rows, fewer than vocab_size {arch.vocab_size}")
    padded = torch.cat([full, full.new_zeros(rows - full.shape[0], full.shape[1])])
    return padded.chunk(tp)[rank]


def _qkv_shard(full: Tensor, arch: ModelArch, tp: int, rank: int) -> Tensor:
    """megatron's per-group ``[q heads of the group; k; v]`` rows -> this rank's ``[q; k; v]``."""
    return deinterleave_qkv(full.chunk(tp)[rank], arch)  # TP splits whole query groups


def rollout_shards_from_full(
    full: dict[str, Tensor],
    arch: ModelArch,
    tp_g: int,
    tp_rank: int,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> dict[str, Tensor]:
    """One rollout rank's tensors from megatron's full state (TP1, real vocab rows; see engine/weights.py),
    the vocab padded to a multiple of ``vocab_divisible_by`` per rank (ours; vLLM's is
    ``vllm_layout.vllm_vocab_divisible_by``).

    The naive oracle of the resharding plan: it slices full tensors, where the plan moves only shards; and
    what a rollout pool loads from the actor's full state.
    """
    check_rollout_tp(arch, tp_g)
    embedding = full["embedding.word_embeddings.weight"]
    out = {"embed_tokens.weight": _vocab_shard(embedding, arch, tp_g, tp_rank, vocab_divisible_by)}
    for i in range(arch.num_layers):
        src, dst = f"decoder.layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[dst + "self_attn.qkv_proj.weight"] = _qkv_shard(
            full[src + "self_attention.linear_qkv.weight"], arch, tp_g, tp_rank
        )
        if arch.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = _qkv_shard(
                full[src + "self_attention.linear_qkv.bias"], arch, tp_g, tp_rank
            )
        if arch.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = full[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = full[src + "self_attention.k_layernorm.weight"]
        out[dst + "self_attn.o_proj.weight"] = full[src + "self_attention.linear_proj.weight"].chunk(tp_g, 1)[
            tp_rank
        ]
        out[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
        mlps = [("mlp.", "mlp.")]
        if arch.moe is not None and arch.is_moe_layer(i):
            out[dst + "mlp.gate.weight"] = full[src + "mlp.router.weight"]
            mlps = [
                (f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.") for e in range(arch.moe.num_experts)
            ]
        for mlp_src, mlp_dst in mlps:
            gate, up = full[src + mlp_src + "linear_fc1.weight"].chunk(2)
            out[dst + mlp_dst + "gate_up_proj.weight"] = torch.cat(
                [gate.chunk(tp_g)[tp_rank], up.chunk(tp_g)[tp_rank]]
            )
            out[dst + mlp_dst + "down_proj.weight"] = full[src + mlp_src + "linear_fc2.weight"].chunk(
                tp_g, 1
            )[tp_rank]
    out["norm.weight"] = full["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = _vocab_shard(
            full["output_layer.weight"], arch, tp_g, tp_rank, vocab_divisible_by
        )
    return {name: t.contiguous() for name, t in out.items()}
