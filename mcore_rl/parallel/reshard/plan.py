"""ReshardPlan: which rank sends which slice of which parameter to whom, train layout -> rollout layout.

Pure and computed once per (model, train layout, rollout layout). The rollout layout has pipeline size 1 and
tensor-parallel size ``tp_g``; its data-parallel size is ``world / tp_g``. Following HybridFlow (§5), each
rank's rollout TP coordinate is chosen so that its rollout shard and its training shard nest (one contains the
other): a rank then keeps what it owns and receives exactly the rest of its rollout shard. Every byte that
arrives is part of the receiver's rollout shard, so no rank ever materialises a tensor (or slice) it does not
keep, and the bytes each rank receives equal the theoretical minimum ``|rollout shard| - |owned part of it|``.

Coordinates are "full" megatron coordinates: a parameter's split dimension is cut into *segments* that TP
splits independently (``linear_fc1`` = [gate; up] has two), measured in *units* (a query group's
``(heads_per_group + 2) * head_dim`` rows for ``linear_qkv``, one row or column otherwise). The executor maps
units to local offsets on both sides (``local_units``) and de-interleaves into the rollout engine's layout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size
from mcore_rl.parallel.sharding import ShardKind

Interval = tuple[int, int, int]  # (segment, start unit, stop unit)


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter as the plan sees it (full, unpadded)."""

    name: str
    shape: tuple[int, ...]
    kind: ShardKind
    layer: int | None
    """Global layer index, or None for embedding / final norm / output layer."""
    split_dim: int = 0
    unit_rows: int = 1
    """Rows (or columns) of the split dim per unit."""
    num_segments: int = 1

    @property
    def units_per_segment(self) -> int:
        return self.shape[self.split_dim] // (self.unit_rows * self.num_segments)

    @property
    def elements_per_unit(self) -> int:
        other = 1
        for dim, size in enumerate(self.shape):
            if dim != self.split_dim:
                other *= size
        return other * self.unit_rows


def model_param_specs(
    *,
    vocab_size: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int,
    qkv_bias: bool,
    tie_word_embeddings: bool,
) -> list[ParamSpec]:
    """Every parameter of a Llama-family GPT in megatron's full-state naming."""
    qkv_unit = (num_attention_heads // num_query_groups + 2) * head_dim
    specs = [ParamSpec("embedding.word_embeddings.weight", (vocab_size, hidden_size), ShardKind.VOCAB, None)]
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        specs += [
            ParamSpec(p + "input_layernorm.weight", (hidden_size,), ShardKind.REPLICATED, i),
            ParamSpec(
                p + "self_attention.linear_qkv.weight",
                (num_query_groups * qkv_unit, hidden_size),
                ShardKind.COLUMN,
                i,
                unit_rows=qkv_unit,
            ),
            ParamSpec(
                p + "self_attention.linear_proj.weight",
                (hidden_size, num_attention_heads * head_dim),
                ShardKind.ROW,
                i,
                split_dim=1,
            ),
            ParamSpec(p + "pre_mlp_layernorm.weight", (hidden_size,), ShardKind.REPLICATED, i),
            ParamSpec(
                p + "mlp.linear_fc1.weight",
                (2 * ffn_hidden_size, hidden_size),
                ShardKind.GATED_COLUMN,
                i,
                num_segments=2,
            ),
            ParamSpec(
                p + "mlp.linear_fc2.weight", (hidden_size, ffn_hidden_size), ShardKind.ROW, i, split_dim=1
            ),
        ]
        if qkv_bias:
            specs.append(
                ParamSpec(
                    p + "self_attention.linear_qkv.bias",
                    (num_query_groups * qkv_unit,),
                    ShardKind.COLUMN,
                    i,
                    unit_rows=qkv_unit,
                )
            )
    specs.append(ParamSpec("decoder.final_layernorm.weight", (hidden_size,), ShardKind.REPLICATED, None))
    if not tie_word_embeddings:
        specs.append(ParamSpec("output_layer.weight", (vocab_size, hidden_size), ShardKind.VOCAB, None))
    return specs


def arch_param_specs(arch: Any) -> list[ParamSpec]:
    """:func:`model_param_specs` for a :class:`~mcore_rl.engine.arch.ModelArch` (duck-typed: plans stay pure)."""
    return model_param_specs(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        head_dim=arch.head_dim,
        qkv_bias=arch.qkv_bias,
        tie_word_embeddings=arch.tie_word_embeddings,
    )


def shard_intervals(spec: ParamSpec, tp: int, coord: int, vocab_divisible_by: int = 128) -> list[Interval]:
    """The full-coordinate intervals held by TP coordinate ``coord`` of ``tp``."""
    if spec.kind is ShardKind.REPLICATED:
        return [(0, 0, spec.units_per_segment)]
    if spec.kind is ShardKind.VOCAB:
        per = padded_vocab_size(spec.shape[0], tp, vocab_divisible_by) // tp
        start, stop = coord * per, min((coord + 1) * per, spec.shape[0])
        return [(0, start, stop)] if stop > start else []
    per = spec.units_per_segment // tp
    return [(s, coord * per, (coord + 1) * per) for s in range(spec.num_segments)]


def local_units(
    spec: ParamSpec, tp: int, coord: int, interval: Interval, vocab_divisible_by: int = 128
) -> int:
    """Offset (in units) of ``interval``'s start inside the local shard of ``coord`` (megatron's shard layout)."""
    segment, start, _ = interval
    offset = 0
    for s, lo, hi in shard_intervals(spec, tp, coord, vocab_divisible_by):
        if s == segment:
            if not lo <= start < hi:
                raise ValueError(
                    f"{spec.name}: unit {start} of segment {segment} is not in shard {coord}/{tp}"
                )
            return offset + start - lo
        offset += hi - lo
    raise ValueError(f"{spec.name}: segment {segment} is not in shard {coord}/{tp}")


def shard_view(spec: ParamSpec, shard: torch.Tensor, local_unit: int, num_units: int) -> torch.Tensor:
    """The ``num_units`` units starting at ``local_unit`` of a local shard (a view, no copy)."""
    return shard.narrow(spec.split_dim, local_unit * spec.unit_rows, num_units * spec.unit_rows)


@dataclass(frozen=True)
class Transfer:
    """Send units [start, stop) of ``segment`` of ``param`` from ``src`` to ``dst``."""

    param: str
    segment: int
    start: int
    stop: int
    src: int
    dst: int
    num_bytes: int


@dataclass
class ReshardPlan:
    """Computed once; see the module docstring. ``transfers`` exclude the data a rank keeps for itself."""

    train: ParallelLayout
    tp_g: int
    rollout_coords: dict[int, tuple[int, int]]
    """rank -> (rollout tp coordinate, rollout dp coordinate)."""
    specs: dict[str, ParamSpec]
    transfers: list[Transfer]
    local_copies: dict[int, list[tuple[str, Interval]]] = field(default_factory=dict)
    """rank -> intervals it keeps from its own training shard."""
    bytes_per_element: int = 4
    train_vocab_divisible_by: int = 128
    rollout_vocab_divisible_by: int = 128

    def received_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.dst] += t.num_bytes
        return {r: out.get(r, 0) for r in range(self.train.world_size)}

    def sent_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.num_bytes
        return {r: out.get(r, 0) for r in range(self.train.world_size)}

    def rollout_groups(self) -> list[list[int]]:
        """Rollout TP groups, each ordered by rollout TP coordinate."""
        groups: dict[int, dict[int, int]] = defaultdict(dict)
        for rank, (tp_coord, dp_coord) in self.rollout_coords.items():
            groups[dp_coord][tp_coord] = rank
        return [[g[c] for c in sorted(g)] for _, g in sorted(groups.items())]

    def buckets(self, max_bytes: int) -> list[list[Transfer]]:
        """Transfers grouped per (src, dst) pair into buckets of at most ``max_bytes`` (one oversize item alone)."""
        by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            by_pair[(t.src, t.dst)].append(t)
        out: list[list[Transfer]] = []
        for _, items in sorted(by_pair.items()):
            bucket: list[Transfer] = []
            size = 0
            for t in items:
                if bucket and size + t.num_bytes > max_bytes:
                    out.append(bucket)
                    bucket, size = [], 0
                bucket.append(t)
                size += t.num_bytes
            out.append(bucket)
        return out
