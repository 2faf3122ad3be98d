"""The mixture-of-experts MLP of the rollout decoder, computed as megatron's MoE layer computes it.

Routing is the trainer's, operation by operation (``megatron.core.transformer.moe.router.TopKRouter`` with an
fp32 router, ``moe_utils.topk_routing_with_score_function``): fp32 logits ``x @ W_router^T``; then, when the
top-k probabilities are renormalised (Mixtral, Qwen3-MoE's ``norm_topk_prob``), top-k of the logits and a
softmax over those k, else top-k of the softmax over all experts. Each expert is megatron's ``SequentialMLP``
expert: ``(silu(x W_gate^T) * (x W_up^T) * p) W_down^T`` with the routing probability ``p`` applied before
the down projection, and each token's expert outputs summed in expert order (megatron's unpermute). With
rollout tensor parallelism every rank holds a slice of every expert's intermediate dimension, so the partial
sums are all-reduced once per layer, like a dense MLP's.

The experts chosen for each token are returned, so the engine can record them (router replay, routing
agreement: ``engine/moe.py``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class ExpertWeights(NamedTuple):
    """One MoE layer's tensors as the decoder uses them."""

    router: Tensor  # [E, h]
    w13: Tensor  # [E, 2 f / tp, h]: every expert's [gate; up] rows, vLLM's fused layout
    w2: Tensor  # [E, h, f / tp]


def allocate_experts(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    """Zero storage for every MoE layer's experts, stacked per layer as ``layers.{i}.mlp.experts.w13`` /
    ``w2`` (what :func:`experts_mlp` takes), plus each expert's rollout-layout name as a view of its slice
    (what the weight sync loads by name)."""
    per_layer: dict[tuple[int, str], dict[int, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = _EXPERT_NAME.match(name)
        if match:
            per_layer.setdefault((int(match.group(1)), match.group(3)), {})[int(match.group(2))] = shape
    out: dict[str, Tensor] = {}
    for (layer, kind), experts in per_layer.items():
        shape = next(iter(experts.values()))
        stacked = torch.zeros((len(experts), *shape), dtype=dtype, device=device)
        out[f"layers.{layer}.mlp.experts.{'w13' if kind == 'gate_up_proj' else 'w2'}"] = stacked
        for e in experts:
            out[f"layers.{layer}.mlp.experts.{e}.{kind}.weight"] = stacked[e]
    return out


def moved_weights(weights: dict[str, Tensor], device: torch.device | str) -> dict[str, Tensor]:
    """``weights`` on ``device``, each expert's name again a view of its layer's moved stacked tensor: a move
    copies every tensor on its own, so moved views would no longer alias what the forward reads (the weight
    sync would then write copies the forward never sees)."""
    moved = {name: t.to(device) for name, t in weights.items() if not _EXPERT_NAME.match(name)}
    for name in weights:
        match = _EXPERT_NAME.match(name)
        if match:
            stacked = (
                f"layers.{match.group(1)}.mlp.experts.{'w13' if match.group(3) == 'gate_up_proj' else 'w2'}"
            )
            moved[name] = moved[stacked][int(match.group(2))]
    return moved


def layer_experts(weights: dict[str, Tensor], layer: int) -> ExpertWeights | None:
    """Layer ``layer``'s MoE tensors from the decoder's weights; None for a dense layer."""
    router = weights.get(f"layers.{layer}.mlp.gate.weight")
    if router is None:
        return None
    prefix = f"layers.{layer}.mlp.experts."
    return ExpertWeights(router, weights[prefix + "w13"], weights[prefix + "w2"])


def route(hidden: Tensor, router_weight: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """hidden [n, h] -> (routing probabilities [n, k] fp32, experts [n, k] int64), as megatron's router."""
    logits = torch.mm(hidden.float(), router_weight.float().t())
    if norm_topk_prob:  # megatron moe_router_pre_softmax=False: softmax over the top-k logits
        scores, experts = torch.topk(logits, k=top_k, dim=1)
        return torch.softmax(scores, dim=-1, dtype=torch.float32), experts
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    probs, experts = torch.topk(scores, k=top_k, dim=1)
    return probs, experts


def probs_of(hidden: Tensor, router_weight: Tensor, experts: Tensor, norm_topk_prob: bool) -> Tensor:
    """The routing probabilities [n, k] of given experts [n, k] (the replay of recorded choices)."""
    logits = torch.mm(hidden.float(), router_weight.float().t())
    if norm_topk_prob:
        return torch.softmax(logits.gather(1, experts), dim=-1, dtype=torch.float32)
    return torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)


def experts_mlp(x: Tensor, probs: Tensor, experts: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """x [n, h], routing [n, k]; w13 [E, 2 f, h] rows [gate; up], w2 [E, h, f] -> [n, h], this rank's partial
    sum over its slice of each expert's intermediate dimension (all-reduce over rollout TP follows)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # expert-major, tokens ascending within each expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    weights = probs.reshape(-1)[order]
    out = torch.zeros(n, w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = torch.mm(x.index_select(0, rows), w13[expert].t()).chunk(2, dim=-1)
        intermediate = (F.silu(gate) * up * weights[start : start + count, None]).to(x.dtype)
        out.index_add_(0, rows, torch.mm(intermediate, w2[expert].t()))
        start += count
    return out
