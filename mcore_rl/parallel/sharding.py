"""How each megatron GPT parameter is split over tensor parallelism, and where its layer lives in the pipeline.

Pure tensor slicing; no process groups. The "full" form of a parameter is its TP=1 megatron tensor with the
*real* vocab (no padding rows); the "shard" form is what one TP rank holds. Two layouts need care:

- ``linear_qkv`` is stored per query group ``[q heads of the group; k; v]``, and TP splits whole query
  groups, so a contiguous split of dim 0 is exact.
- ``linear_fc1`` of a gated MLP is ``[gate; up]`` and each TP rank holds ``[gate_r; up_r]``, so gate and
  up are split separately.

Mixture-of-experts layers add a router (replicated) and experts, whose ``linear_fc1`` / ``linear_fc2`` split
like the dense MLP's but over the *expert* tensor-parallel group (``parallel/layout.py``'s expert mesh); an
expert parallel rank holds a contiguous block of the experts. The full state names expert ``e`` (global index)
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``, megatron's ``SequentialMLP`` name at
EP1; Transformer Engine's grouped GEMM names the same weight ``mlp.experts.linear_fc1.weight{j}``.
"""

from __future__ import annotations

import re
from enum import Enum

import torch


class ShardKind(Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # split dim 0
    ROW = "row"  # split dim 1
    GATED_COLUMN = "gated_column"  # [gate; up], each half split on dim 0
    VOCAB = "vocab"  # split dim 0 after padding to the padded vocab


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
EXPERT_MARK = ".mlp.experts."


def is_expert_param(name: str) -> bool:
    """Whether ``name`` is a routed expert's weight (split over the expert mesh, not the dense one)."""
    return EXPERT_MARK in name


def expert_param_name(layer: int, expert: int, suffix: str) -> str:
    """Full-state name of global expert ``expert``'s ``suffix`` (``linear_fc1.weight`` / ``linear_fc2.weight``)."""
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{suffix}"


def expert_index(name: str) -> int | None:
    """The global expert index of a full-state expert name; None for every other parameter."""
    match = _LAYER.match(name)
    if match is None:
        return None
    expert = _SEQUENTIAL_EXPERT.match(match.group(2))
    return int(expert.group(1)) if expert else None


def shard_kind(name: str, value_head: bool = False) -> ShardKind:
    """The TP split of megatron parameter ``name`` (local or global layer numbering alike)."""
    if name.endswith("mlp.router.weight"):
        return ShardKind.REPLICATED
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return ShardKind.REPLICATED if value_head and name.startswith("output_layer") else ShardKind.VOCAB
    if "layernorm" in name or "layer_norm" in name or name.endswith("norm.weight"):
        return ShardKind.REPLICATED
    if ".linear_qkv." in name:
        return ShardKind.COLUMN
    if ".linear_fc1." in name:
        return ShardKind.GATED_COLUMN
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return ShardKind.ROW
    if name.endswith("linear_proj.bias") or name.endswith("linear_fc2.bias"):
        return ShardKind.REPLICATED
    raise KeyError(f"no TP sharding rule for parameter {name!r}")


def tp_shard(
    full: torch.Tensor, kind: ShardKind, tp_rank: int, tp_size: int, padded_rows: int | None = None
) -> torch.Tensor:
    """The slice of ``full`` held by ``tp_rank`` (a view where possible)."""
    if kind is ShardKind.REPLICATED or (tp_size == 1 and kind is not ShardKind.VOCAB):
        return full
    if kind is ShardKind.VOCAB:
        rows = padded_rows if padded_rows is not None else full.shape[0]
        if rows < full.shape[0] or rows % tp_size:
            raise ValueError(f"padded vocab {rows} must be >= {full.shape[0]} and divisible by tp={tp_size}")
        per = rows // tp_size
        out = full.new_zeros((per, *full.shape[1:]))
        start, stop = tp_rank * per, min((tp_rank + 1) * per, full.shape[0])
        if stop > start:
            out[: stop - start] = full[start:stop]
        return out
    if kind is ShardKind.ROW:
        return torch.chunk(full, tp_size, dim=1)[tp_rank] if full.dim() > 1 else full
    if kind is ShardKind.GATED_COLUMN:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat(
            [torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]]
        )
    return torch.chunk(full, tp_size, dim=0)[tp_rank]


def tp_merge(shards: list[torch.Tensor], kind: ShardKind, real_rows: int | None = None) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks' shards; drops vocab padding rows."""
    if kind is ShardKind.REPLICATED:
        return shards[0]
    if kind is ShardKind.ROW:
        return torch.cat(shards, dim=1) if shards[0].dim() > 1 else shards[0]
    if kind is ShardKind.GATED_COLUMN:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    merged = torch.cat(shards, dim=0)
    if kind is ShardKind.VOCAB and real_rows is not None:
        merged = merged[:real_rows]
    return merged


# Transformer-Engine's spec fuses the pre-attention / pre-MLP norms into the following linear layer; the full
# state always uses the local spec's names so checkpoints and conversions do not depend on the spec.
_TE_TO_CANONICAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def global_param_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Canonical full-state name of a chunk-local parameter: global layer number, local-spec naming, global
    expert index (``expert_offset`` = this rank's first expert)."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    layer, suffix = int(match.group(1)) + layer_offset, match.group(2)
    sequential = _SEQUENTIAL_EXPERT.match(suffix)
    if sequential:
        return expert_param_name(layer, int(sequential.group(1)) + expert_offset, sequential.group(2))
    grouped = _GROUPED_EXPERT.match(suffix)
    if grouped:
        fc, kind, local = grouped.groups()
        return expert_param_name(layer, int(local) + expert_offset, f"{fc}.{kind}")
    return f"decoder.layers.{layer}.{_TE_TO_CANONICAL.get(suffix, suffix)}"
