"""Exact parameter counts: the whole model, the part one token uses, and what one training rank holds in
megatron's layout.

Per transformer layer, with ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, ``f`` the MLP width and
``t`` the TP size (megatron's names; the TE spec fuses the norms into the linears, same counts)::

    input_layernorm        h                      replicated over TP
    linear_qkv             (q + 2 kv) * h / t     (+ (q + 2 kv) / t bias for Qwen2)
    q/k_layernorm          2 head_dim             replicated (Qwen3)
    linear_proj            h * q / t
    pre_mlp_layernorm      h                      replicated
    linear_fc1             2 f * h / t            gate and up, fused
    linear_fc2             h * f / t

A mixture-of-experts layer (Qwen3-MoE, Mixtral: :attr:`ModelArch.moe`) replaces the MLP by a router and
``E`` experts of width ``f_e``, of which each token uses ``k``; with expert parallelism ``ep`` and expert
tensor parallelism ``etp`` (``parallel/layout.py``)::

    router.weight          E * h                  replicated over TP (megatron's TopKRouter; a dense weight)
    experts                E / ep experts, each 2 f_e * h / etp (fc1) + h * f_e / etp (fc2)

The dense weights (everything but the experts) are replicated over the DP ranks, and the distributed
optimizer shards their state over DP; the experts of one (ETP, EP) coordinate are replicated over the
expert-data-parallel ranks, ``edp = world / (etp * ep * pp)``, which shard their state instead.

The first stage adds the embedding ``V_pad / t * h``; the last adds the final norm ``h`` and the output
layer ``V_pad / t * h``, except with tied embeddings on one stage (the embedding serves both), and a critic
replaces it by a replicated value head ``h``. With tied embeddings and PP > 1 megatron keeps a synchronised
copy of the embedding on the last stage, so it counts there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, by how the optimizer shards them."""

    dense: int
    """Everything but the experts: state sharded over the DP ranks."""
    expert: int = 0
    """This rank's experts (``E / ep`` per MoE layer, each split over ETP): state sharded over expert DP."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def attention_params(arch: ModelArch, tp: int = 1) -> int:
    """One layer's attention and both norms on one TP rank: everything but the MLP."""
    hidden = arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    qkv = (q + 2 * kv) * hidden + ((q + 2 * kv) if arch.qkv_bias else 0)
    qk_norms = 2 * arch.head_dim if arch.qk_norm else 0  # Qwen3: replicated over TP
    return (qkv + hidden * q) // tp + 2 * hidden + qk_norms


def layer_params(arch: ModelArch, tp: int = 1) -> int:
    """Parameters of one dense transformer layer on one TP rank."""
    return attention_params(arch, tp) + 3 * arch.ffn_hidden_size * arch.hidden_size // tp


def expert_params(arch: ModelArch, etp: int = 1) -> int:
    """One expert's fc1 (gate and up) and fc2 on one expert-TP rank (0 for a dense model)."""
    if arch.moe is None:
        return 0
    return 3 * arch.moe.ffn_hidden_size * arch.hidden_size // etp


def router_params(arch: ModelArch) -> int:
    """One MoE layer's router ``[E, h]`` (0 for a dense model)."""
    return 0 if arch.moe is None else arch.moe.num_experts * arch.hidden_size


def layer_split(arch: ModelArch, layer: int, layout: ParallelLayout) -> RankParams:
    """Global layer ``layer`` on one rank of ``layout``: dense weights and the rank's experts."""
    if arch.moe is None or not arch.is_moe_layer(layer):
        return RankParams(dense=layer_params(arch, layout.tp))
    experts = arch.moe.num_experts // layout.ep
    return RankParams(
        dense=attention_params(arch, layout.tp) + router_params(arch),
        expert=experts * expert_params(arch, layout.expert_tp),
    )


def _embeddings(arch: ModelArch) -> int:
    """Embedding, output layer (untied) and final norm at the real vocab size."""
    tables = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return tables + arch.hidden_size


def model_params(arch: ModelArch) -> int:
    """The full model's parameter count with the real (unpadded) vocab: the number HF reports."""
    whole = ParallelLayout(1)
    return _embeddings(arch) + sum(layer_split(arch, i, whole).total for i in range(arch.num_layers))


def active_params(arch: ModelArch) -> int:
    """Parameters one token's forward pass uses ("activated" on the MoE model cards): every dense weight,
    the embedding and output layer, each MoE layer's router and ``top_k`` of its experts."""
    if arch.moe is None:
        return model_params(arch)
    routed = len(arch.moe.layers) * (arch.moe.num_experts - arch.moe.top_k) * expert_params(arch)
    return model_params(arch) - routed


def stage_split(arch: ModelArch, layout: ParallelLayout, stage: int, value_head: bool = False) -> RankParams:
    """Parameters one rank of pipeline stage ``stage`` holds (all its virtual chunks together)."""
    vocab_rows = padded_vocab_size(arch.vocab_size, layout.tp, VOCAB_DIVISIBLE_BY) // layout.tp
    layers = [
        layer_split(arch, i, layout) for chunk in layout.stage_layers(arch.num_layers)[stage] for i in chunk
    ]
    dense = sum(p.dense for p in layers)
    if stage == 0:
        dense += vocab_rows * arch.hidden_size
    if stage == layout.pp - 1:
        dense += arch.hidden_size  # final norm
        if value_head:
            dense += arch.hidden_size
        elif not (arch.tie_word_embeddings and layout.pp == 1):
            dense += vocab_rows * arch.hidden_size
    return RankParams(dense=dense, expert=sum(p.expert for p in layers))


def stage_params(arch: ModelArch, layout: ParallelLayout, stage: int, value_head: bool = False) -> int:
    """All parameters one rank of pipeline stage ``stage`` holds."""
    return stage_split(arch, layout, stage, value_head).total


def rank_split(arch: ModelArch, layout: ParallelLayout, value_head: bool = False) -> tuple[int, RankParams]:
    """``(stage, params)`` of the most loaded pipeline stage (the first on ties)."""
    splits = [stage_split(arch, layout, p, value_head) for p in range(layout.pp)]
    stage = max(range(layout.pp), key=lambda p: (splits[p].total, -p))
    return stage, splits[stage]


def rank_params(arch: ModelArch, layout: ParallelLayout, value_head: bool = False) -> tuple[int, int]:
    """``(stage, params)`` of the most loaded pipeline stage (the first on ties)."""
    stage, split = rank_split(arch, layout, value_head)
    return stage, split.total
