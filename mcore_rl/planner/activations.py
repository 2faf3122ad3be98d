"""Training activation memory on one GPU, after Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198, §4 and Table 2), generalised to grouped-query attention and a
gated (SwiGLU) MLP, and megatron's pipeline accounting (``theoretical_memory_usage.py``).

Stored for backward per layer and micro-batch, in elements (``e`` bytes each: 2 in bf16, 4 in fp32), with
``s`` tokens, ``b`` sequences, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, ``f`` the MLP width:

    along the full hidden width (replicated over TP, split by sequence with SP):
        2 norm inputs (2 s b h), QKV input (s b h), fc1 input (s b h)               = 4 s b h
    split over TP:
        Q (s b q), K and V (2 s b kv), attention output = proj input (s b q),
        fc1 output = SwiGLU input (2 s b f), SwiGLU output = fc2 input (s b f)      = s b (2q + 2kv + 3f)
    attention scores, split over TP, only without a fused kernel and without selective recompute:
        softmax output (heads * s^2 * b)

For MHA with a 4h GeLU MLP this is the paper's ``sbh (10 + 24/t + 5as/(ht))`` minus its dropout masks and
the dropout output: our models train without dropout.

Context parallelism (``cp``) gives each rank ``s / cp`` of every sequence's tokens, so every term above
counts ``s / cp`` tokens, as megatron's ``theoretical_memory_usage`` divides by ``cp``. Two terms depend on
the attention: TE's ring (``cp_comm="p2p"``, GPUs) keeps only this rank's K and V, an all-gather attention
(``cp_comm="all_gather"``: ours on the local spec, ``compat/context_attention.py``, which recomputes its
masked attention in backward and stores no scores) keeps every token's K and V of the layer, ``2 s b kv / t``
in all; and an unfused attention's scores would be two chunks of ``c = s / 2cp`` queries against the keys
before them, ``heads * b * c^2 * (2 cp + 1) / t`` (every rank the same, by the chunk order). Full recompute keeps only each layer's input (s b h,
split by SP), plus one layer's full set while that layer is recomputed.

Pipelining: the first stage holds its ``L / pp`` layers for every micro-batch in flight: ``min(pp, m)``
with 1F1B, and ``pp * (1 + (pp - 1) / (pp * vpp))`` with the interleaved schedule (megatron's penalty).

The last stage also holds its LM head's working set for one micro-batch (``LM head``). The head never
materialises the ``n x V_pad / t`` logits (``n = s b / cp`` tokens, every position on every TP rank: SP
gathers them): ``engine/lm_head.py`` runs the fused ``ops.logprob.linear_logprob_entropy`` on a masked copy of
the final hidden states, whose forward streams vocab chunks of ``c = min(4096, V_pad / t)`` columns (real rows
only) keeping only per-row statistics (on a GPU no chunk's logits are kept, ``lm_head.keep_logits_bytes``) and
whose backward recomputes each chunk. Its peak is in that backward, in bytes with ``e`` the compute dtype's
size:

    saved hidden rows (the masked copy)                          e n h
    their gradient, accumulated in fp32                          4 n h
    one logits block and one gradient block, reused by chunks    2 e n c
    the output weight's gradient, a trainable head only          e h V_pad / t
    bf16 only, the largest temporary of the update               e h max(n, c), frozen head e h n
        (the [n, h] product added to the fp32 accumulator, or its final cast to bf16; the [c, h]
        weight-gradient block. fp32 accumulates both in place and its cast is a no-op)

LoRA freezes the output layer (its adapters sit in the decoder layers only): no weight gradient, no [c, h]
block. Logits the forward keeps (``model.keep_logits_gib``, ``keep_logits_bytes``; none on a GPU unless set)
add ``e n k`` for the ``k`` columns of the whole chunks the budget holds, held from the forward to the
backward; with every chunk kept there is no logits block to recompute into. Left out: per-row statistics
and incoming gradients (a few fp32 per token). The forward's own peak (``e n h + e n c``) is below the
backward's. ``tests/planner/test_lm_head.py`` runs the real head on CPU and finds these bytes at its peak.

Mixture-of-experts layers keep the same attention side and norms (the router's input is the pre-MLP norm's
output, the "fc1 input" above) but no dense MLP: their expert activations and router tensors are their own
terms, sized in ``moe.py`` and summed here over the stage's MoE layers. Full recompute keeps only the layer
inputs of MoE layers too, plus one layer's whole set (the largest of the stage's layers).
"""

from __future__ import annotations

from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.ops.logprob import DEFAULT_VOCAB_CHUNK, chunks_kept, kept_columns, vocab_chunks
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.planner.moe import expert_activation_bytes, router_bytes
from mcore_rl.planner.spec import PlanInput

TOKEN_ID_BYTES = 16
"""Per token on the first stage: int64 token ids and int64 position ids."""

ACTIVATION_TERMS = ("activations", "expert activations", "router logits")
"""The stored-activation terms of the train phase; the last two only for mixture-of-experts models."""


def layer_activation_bytes(plan: PlanInput, recompute: str | None = None, moe: bool = False) -> float:
    """Bytes one layer stores for one micro-batch on one GPU (see the module docstring); for an MoE layer
    (``moe``) without its expert activations and router tensors (``moe.py``)."""
    arch = plan.arch
    recompute = recompute or plan.recompute
    e = 2 if plan.bf16 else 4
    tokens = plan.seq_length * plan.micro_batch_size / plan.cp  # this rank's share under CP
    sequence_split = plan.tp if plan.sp else 1
    if recompute == "full":
        return e * tokens * arch.hidden_size / sequence_split
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    mlp = 0 if moe else 3 * arch.ffn_hidden_size
    hidden_width = 4 * tokens * arch.hidden_size / sequence_split
    tp_split = tokens * (2 * q + 2 * kv + mlp) / plan.tp
    scores = gathered_kv = 0.0
    if plan.cp > 1 and plan.cp_comm == "all_gather":  # the other ranks' K and V, kept for backward
        gathered_kv = 2 * (plan.seq_length * plan.micro_batch_size - tokens) * kv / plan.tp
    if recompute == "none" and not plan.flash_attention:
        scores = arch.num_attention_heads * _score_cells(plan) * plan.micro_batch_size / plan.tp
    return e * (hidden_width + tp_split + gathered_kv + scores)


def _score_cells(plan: PlanInput) -> float:
    """Query-key pairs of one sequence's attention scores on one rank: ``s x s`` (megatron's local attention
    keeps the masked half too), under CP two chunks of ``c = s / 2cp`` queries against ``(r + 1) c`` and
    ``(2 cp - r) c`` keys (module docstring)."""
    if plan.cp == 1:
        return float(plan.seq_length) ** 2
    chunk = plan.seq_length / (2 * plan.cp)
    return chunk * chunk * (2 * plan.cp + 1)


def _layer_terms(plan: PlanInput, moe: bool, recompute: str | None = None) -> tuple[float, int, int]:
    """(dense-side bytes, expert activations, router tensors) one layer stores for one micro-batch."""
    dense = layer_activation_bytes(plan, recompute, moe)
    if not moe or (recompute or plan.recompute) == "full":
        return dense, 0, 0
    return dense, expert_activation_bytes(plan), router_bytes(plan)


def microbatches_in_flight(plan: PlanInput) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    if plan.pp == 1:
        return 1.0
    if plan.vpp:
        return plan.pp * (1 + (plan.pp - 1) / (plan.pp * plan.vpp))
    return float(min(plan.pp, plan.num_microbatches))


def activation_terms(plan: PlanInput) -> dict[str, int]:
    """Peak stored activations of the first stage (the most loaded one under 1F1B), by term: the dense side
    of every layer and the token ids (``activations``), and for MoE models the experts' and routers'."""
    arch = plan.arch
    layers = [i for chunk in plan.layout.stage_layers(arch.num_layers)[0] for i in chunk]
    kinds = [arch.is_moe_layer(i) for i in layers]
    tokens = plan.seq_length * plan.micro_batch_size // plan.cp
    per_layer = [_layer_terms(plan, moe) for moe in kinds]
    stored = [sum(term[j] for term in per_layer) for j in range(3)]
    stored[0] += TOKEN_ID_BYTES * tokens
    in_flight = microbatches_in_flight(plan)
    stored = [value * in_flight for value in stored]
    if plan.recompute == "full":  # the layer being recomputed holds its whole set
        recomputed = max((_layer_terms(plan, moe, recompute="selective") for moe in set(kinds)), key=sum)
        stored = [value + extra for value, extra in zip(stored, recomputed, strict=True)]
    names = ACTIVATION_TERMS if arch.moe is not None else ACTIVATION_TERMS[:1]
    return {name: int(value) for name, value in zip(names, stored, strict=False)}


def lm_head_bytes(plan: PlanInput) -> int:
    """The LM head's peak on the last stage for one micro-batch of this CP rank's tokens: the fused log-prob
    op's backward (module docstring), with a weight gradient only when the head trains (not under LoRA)."""
    e = 2 if plan.bf16 else 4
    hidden = plan.arch.hidden_size
    vocab_rows = padded_vocab_size(plan.arch.vocab_size, plan.tp, VOCAB_DIVISIBLE_BY) // plan.tp
    tokens = plan.seq_length * plan.micro_batch_size // plan.cp  # each CP rank projects its own tokens
    # rank 0's chunks: the most real vocab rows of any rank, its first chunk the widest; kept as the op keeps
    chunks = vocab_chunks(vocab_rows, 0, plan.arch.vocab_size, DEFAULT_VOCAB_CHUNK)
    real_rows, columns = chunks[-1][1], chunks[0][1]
    kept = kept_columns(chunks, chunks_kept(chunks, plan.keep_logits_bytes, e * tokens))
    trainable_head = plan.lora_rank == 0
    weight_grad = e * vocab_rows * hidden if trainable_head else 0
    temporary = 0  # fp32: the op accumulates both gradients in place and its final cast is a no-op
    if plan.bf16:
        temporary = e * hidden * max(tokens, columns if trainable_head else 0)
    blocks = 2 if kept < real_rows else 1  # every chunk kept: no logits block to recompute into
    return (
        e * tokens * hidden
        + 4 * tokens * hidden
        + blocks * e * tokens * columns
        + e * tokens * kept
        + weight_grad
        + temporary
    )
