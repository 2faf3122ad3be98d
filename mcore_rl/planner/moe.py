"""The mixture-of-experts terms of the planner (Qwen3-MoE, Mixtral): what megatron-core 0.16's ``MoELayer``
(``TopKRouter``, ``MoEAlltoAllTokenDispatcher``, grouped / sequential experts) keeps on one training rank,
and what vLLM's fused-MoE layer holds on one rollout rank.

Names: ``T`` tokens of one micro-batch that enter the router on this rank (``s b / tp`` under sequence
parallelism, which megatron requires for MoE with TP > 1; ``s b`` at TP1), ``k`` experts per token, ``E``
experts, ``f_e`` an expert's width, ``h`` the hidden size, ``e`` bytes per activation element (2 in bf16).
Routing is taken as balanced (what the load-balancing loss aims at): an EP rank receives the share
``T k`` of the routed rows it would get if every expert saw the same number of tokens; a skewed router sends
one rank more (dropless routing: no capacity cap), and that rank needs proportionally more.

Training, per MoE layer and micro-batch, kept for the backward pass (``expert activations``)::

    R = T k etp         rows one rank's experts process: the all-to-all over EP brings the T k rows routed
                        to this rank's experts, the all-gather over the expert-TP group those of its etp peers
    fc1 input           R h        the dispatched tokens, sorted by local expert (what the expert GEMM keeps)
    fc1 output          R 2 f_e / etp    the SwiGLU input (gate and up)
    SwiGLU output       R f_e / etp      the fc2 input; the routing weight multiplies it inside the fused
                                         weighted SwiGLU (``bias_activation_fusion``, as the engine builds
                                         it), which keeps only its input and the weights
    routing weights     4 R        the permuted top-k probabilities (fp32) for that product's backward

and the router's (``router logits``): megatron keeps fp32 ``[T, E]`` tensors per layer: the softmax scores
for the load-balancing loss's backward (or the full softmax that picks the top-k without ``norm_topk_prob``;
the logits themselves with the z-loss), and the dense probabilities plus the boolean routing map the
dispatcher holds until the layer's backward: ``T E (4 + 4 + 1)`` bytes, an upper bound (the router's input
is the pre-MLP norm's output, already among the dense activations).

Not kept, but live while one MoE layer runs (``dispatcher buffers``, counted once: the layers run one at a
time): the all-to-all's send buffer (the T k permuted rows) and its receive buffer, ``2 T k h e``; with
ETP > 1 the combine is larger: the experts' R output rows, their fp32 copy for the reduce-scatter over the
expert-TP group and its fp32 result, ``T k h (etp (e + 4) + 4)``.

Rollout (vLLM without expert parallelism, ``enable_expert_parallel`` off): every rollout TP rank holds all
``E`` experts of every MoE layer, each split over the rollout TP (``w13 [E, 2 f_e / tp, h]``,
``w2 [E, h, f_e / tp]``), and the replicated router ``[E, h]``; the fused-MoE kernel's caches for one
forward hold ``k (2 f_e / tp + f_e / tp + h)`` elements per token, plus the fp32 router logits ``4 E``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.layout import rollout_param_shapes
from mcore_rl.planner.spec import PlanInput

ROUTER_BYTES_PER_TOKEN_EXPERT = 9
"""fp32 scores + fp32 dense probabilities + the boolean routing map, per token and expert."""


def router_tokens(plan: PlanInput) -> int:
    """``T``: tokens of one micro-batch that enter each MoE layer's router on one rank."""
    tokens = plan.seq_length * plan.micro_batch_size
    return tokens // plan.tp if plan.sp else tokens


def expert_rows(plan: PlanInput) -> int:
    """``R = T k etp``: rows this rank's experts process per MoE layer and micro-batch (balanced routing)."""
    assert plan.arch.moe is not None
    return router_tokens(plan) * plan.arch.moe.top_k * plan.layout.expert_tp


def expert_activation_bytes(plan: PlanInput) -> int:
    """One MoE layer's expert activations kept for backward, one micro-batch: ``R (h + 3 f_e / etp) e + 4 R``."""
    moe = plan.arch.moe
    assert moe is not None
    e = 2 if plan.bf16 else 4
    rows = expert_rows(plan)
    width = plan.arch.hidden_size + 3 * moe.ffn_hidden_size // plan.layout.expert_tp
    return rows * width * e + 4 * rows


def router_bytes(plan: PlanInput) -> int:
    """One MoE layer's router tensors kept for backward, one micro-batch: ``T E 9``."""
    assert plan.arch.moe is not None
    return router_tokens(plan) * plan.arch.moe.num_experts * ROUTER_BYTES_PER_TOKEN_EXPERT


def dispatcher_bytes(plan: PlanInput) -> int:
    """The all-to-all dispatcher's transient buffers while one MoE layer runs (see the module docstring)."""
    moe = plan.arch.moe
    if moe is None:
        return 0
    e = 2 if plan.bf16 else 4
    routed = router_tokens(plan) * moe.top_k * plan.arch.hidden_size  # T k h
    etp = plan.layout.expert_tp
    if etp == 1:
        return 2 * routed * e
    return routed * (etp * (e + 4) + 4)


def rollout_weight_numel(arch: ModelArch, rollout_tp: int) -> int:
    """Parameters on one rollout TP rank: the dense rollout layout with each MoE layer's MLP replaced by its
    replicated router and all ``E`` experts, each split over ``rollout_tp``. The attention, norms and
    embeddings come from :func:`rollout_param_shapes` of the model without experts (one name per tensor; the
    per-expert names of the MoE layout would cost the search a dict of ``layers x E`` entries per plan)."""
    dense = replace(arch, moe=None)
    numel = sum(math.prod(shape) for shape in rollout_param_shapes(dense, rollout_tp).values())
    if arch.moe is None:
        return numel
    dense_mlp = 3 * (arch.ffn_hidden_size // rollout_tp) * arch.hidden_size  # gate_up_proj + down_proj
    experts = arch.moe.num_experts * 3 * (arch.moe.ffn_hidden_size // rollout_tp) * arch.hidden_size
    router = arch.moe.num_experts * arch.hidden_size
    return numel + len(arch.moe.layers) * (experts + router - dense_mlp)


def rollout_mlp_token_bytes(plan: PlanInput) -> int:
    """Bytes per token of the widest MLP in one rollout forward: the dense gate/up output and its activation
    ``3 f / tp``, or the fused-MoE caches and fp32 router logits of an MoE layer (module docstring)."""
    arch, rtp = plan.arch, plan.rollout_tp
    e = plan.rollout_element_bytes
    moe = arch.moe
    dense = 3 * arch.ffn_hidden_size // rtp * e
    if moe is None:
        return dense
    sparse = moe.top_k * (3 * moe.ffn_hidden_size // rtp + arch.hidden_size) * e + 4 * moe.num_experts
    has_dense = len(moe.layers) < arch.num_layers
    return max(sparse, dense if has_dense else 0)
