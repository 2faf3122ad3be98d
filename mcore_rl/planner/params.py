"""Exact parameter counts: the whole model, and what one training rank holds in megatron's layout.

Per transformer layer, with ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, ``f`` the MLP width and
``t`` the TP size (megatron's names; the TE spec fuses the norms into the linears, same counts)::

    input_layernorm        h                      replicated over TP
    linear_qkv             (q + 2 kv) * h / t     (+ (q + 2 kv) / t bias for Qwen2)
    q/k_layernorm          2 head_dim             replicated (Qwen3)
    linear_proj            h * q / t
    pre_mlp_layernorm      h                      replicated
    linear_fc1             2 f * h / t            gate and up, fused
    linear_fc2             h * f / t

The first stage adds the embedding ``V_pad / t * h``; the last adds the final norm ``h`` and the output
layer ``V_pad / t * h``, except with tied embeddings on one stage (the embedding serves both), and a critic
replaces it by a replicated value head ``h``. With tied embeddings and PP > 1 megatron keeps a synchronised
copy of the embedding on the last stage, so it counts there too.
"""

from __future__ import annotations

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size


def layer_params(arch: ModelArch, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank."""
    hidden = arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    qkv = (q + 2 * kv) * hidden + ((q + 2 * kv) if arch.qkv_bias else 0)
    sharded = qkv + hidden * q + 3 * arch.ffn_hidden_size * hidden
    qk_norms = 2 * arch.head_dim if arch.qk_norm else 0  # Qwen3: replicated over TP
    return sharded // tp + 2 * hidden + qk_norms


def model_params(arch: ModelArch) -> int:
    """The full model's parameter count with the real (unpadded) vocab: the number HF reports."""
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return embeddings + arch.num_layers * layer_params(arch) + arch.hidden_size


def stage_params(arch: ModelArch, layout: ParallelLayout, stage: int, value_head: bool = False) -> int:
    """Parameters one TP rank of pipeline stage ``stage`` holds (all its virtual chunks together)."""
    vocab_rows = padded_vocab_size(arch.vocab_size, layout.tp, VOCAB_DIVISIBLE_BY) // layout.tp
    count = arch.num_layers // layout.pp * layer_params(arch, layout.tp)
    if stage == 0:
        count += vocab_rows * arch.hidden_size
    if stage == layout.pp - 1:
        count += arch.hidden_size  # final norm
        if value_head:
            count += arch.hidden_size
        elif not (arch.tie_word_embeddings and layout.pp == 1):
            count += vocab_rows * arch.hidden_size
    return count


def rank_params(arch: ModelArch, layout: ParallelLayout, value_head: bool = False) -> tuple[int, int]:
    """``(stage, params)`` of the most loaded pipeline stage (the first on ties)."""
    counts = [stage_params(arch, layout, p, value_head) for p in range(layout.pp)]
    stage = max(range(layout.pp), key=lambda p: (counts[p], -p))
    return stage, counts[stage]
