"""ReshardPlan: which rank sends which slice of which parameter to whom, train layout -> rollout layout.

Pure and computed once per (model, train layout, rollout layout). The rollout layout has pipeline size 1 and
tensor-parallel size ``tp_g``; its data-parallel size is ``world / tp_g``. Following HybridFlow (§5), each
rank's rollout TP coordinate is chosen so that its rollout shard and its training shard nest (one contains the
other): a rank then keeps what it owns and receives exactly the rest of its rollout shard. Every byte that
arrives is part of the receiver's rollout shard, so no rank ever materialises a tensor (or slice) it does not
keep, and the bytes each rank receives equal the theoretical minimum ``|rollout shard| - |owned part of it|``.

Mixture-of-experts weights are planned like the rest, with two differences: a routed expert's training shards
follow the *expert* mesh (its owners are the ranks of the EP block holding it, split over expert TP, see
``parallel/layout.py``), while the rollout holds every expert on every replica, split over the rollout TP
(as vLLM does without expert parallelism). So an EP rank keeps its own experts' rollout slices and receives
only the other experts' slices of its rollout shard: again exactly ``|rollout shard| - |owned part of it|``.

Coordinates are "full" megatron coordinates: a parameter's split dimension is cut into *segments* that TP
splits independently (``linear_fc1`` = [gate; up] has two), measured in *units* (a query group's
``(heads_per_group + 2) * head_dim`` rows for ``linear_qkv``, one row or column otherwise). The executor maps
units to local offsets on both sides (``local_units``) and de-interleaves into the rollout engine's layout.

Scheduling is pure too: ``ReshardPlan.rounds`` splits transfers into messages of at most ``bucket_bytes``
(``split_transfer``, ``pair_buckets``) and assigns every message to a round (``schedule_rounds``) so that no
rank has more than ``max_inflight_bytes`` in flight; every rank derives the same schedule on its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size
from mcore_rl.parallel.reshard.naming import EMBEDDING_KEY, OUTPUT_KEY
from mcore_rl.parallel.sharding import ShardKind

Interval = tuple[int, int, int]  # (segment, start unit, stop unit)
T = TypeVar("T")


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
    expert: int | None = None
    """Global index of a routed expert's weight (split over the expert mesh); None for every other one."""
    num_experts: int = 0
    """Experts per MoE layer (with ``expert``)."""

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
    qk_norm: bool = False,
    moe: Any = None,
) -> list[ParamSpec]:
    """Every parameter of a Llama-family GPT in megatron's full-state naming; ``moe`` (an
    ``engine.arch.MoESpec``, duck-typed) adds routers and experts to its layers."""
    qkv_unit = (num_attention_heads // num_query_groups + 2) * head_dim
    specs = [ParamSpec(EMBEDDING_KEY, (vocab_size, hidden_size), ShardKind.VOCAB, None)]
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
        ]
        if moe is not None and i in moe.layers:
            specs += _moe_specs(moe, hidden_size, i)
        else:
            specs += _mlp_specs(p, hidden_size, ffn_hidden_size, i)
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
        if qk_norm:  # Qwen3's per-head q/k RMSNorm weights: one vector of head_dim, the same on every rank
            specs += [
                ParamSpec(p + f"self_attention.{n}_layernorm.weight", (head_dim,), ShardKind.REPLICATED, i)
                for n in ("q", "k")
            ]
    specs.append(ParamSpec("decoder.final_layernorm.weight", (hidden_size,), ShardKind.REPLICATED, None))
    if not tie_word_embeddings:
        specs.append(ParamSpec(OUTPUT_KEY, (vocab_size, hidden_size), ShardKind.VOCAB, None))
    return specs


def _mlp_specs(
    p: str, hidden: int, ffn: int, layer: int, expert: int | None = None, experts: int = 0
) -> list[ParamSpec]:
    """A gated MLP's fc1 ([gate; up], column-parallel) and fc2 (row-parallel)."""
    return [
        ParamSpec(
            p + "mlp.linear_fc1.weight" if expert is None else p + "linear_fc1.weight",
            (2 * ffn, hidden),
            ShardKind.GATED_COLUMN,
            layer,
            num_segments=2,
            expert=expert,
            num_experts=experts,
        ),
        ParamSpec(
            p + "mlp.linear_fc2.weight" if expert is None else p + "linear_fc2.weight",
            (hidden, ffn),
            ShardKind.ROW,
            layer,
            split_dim=1,
            expert=expert,
            num_experts=experts,
        ),
    ]


def _moe_specs(moe: Any, hidden: int, layer: int) -> list[ParamSpec]:
    """A MoE layer's router (replicated) and every expert's MLP, in expert order."""
    p = f"decoder.layers.{layer}."
    specs = [ParamSpec(p + "mlp.router.weight", (moe.num_experts, hidden), ShardKind.REPLICATED, layer)]
    for e in range(moe.num_experts):
        prefix = f"{p}mlp.experts.local_experts.{e}."
        specs += _mlp_specs(prefix, hidden, moe.ffn_hidden_size, layer, e, moe.num_experts)
    return specs


def train_split(train: ParallelLayout, spec: ParamSpec, rank: int) -> tuple[int, int]:
    """(size, coordinate) of the training split holding ``spec`` on ``rank``: the expert TP group for routed
    experts, the TP group for everything else."""
    if spec.expert is None:
        return train.tp, train.coords(rank).tp
    return train.expert_tp, train.expert_coords(rank).etp


def holds(train: ParallelLayout, spec: ParamSpec, rank: int) -> bool:
    """Whether ``rank``'s expert-parallel block holds ``spec`` (always true for non-expert weights; their
    pipeline stage is the caller's business)."""
    return spec.expert is None or spec.expert in train.local_experts(rank, spec.num_experts)


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
        qk_norm=getattr(arch, "qk_norm", False),
        moe=getattr(arch, "moe", None),
    )


def padded_rows(spec: ParamSpec, tp: int, vocab_divisible_by: int = 128) -> int | None:
    """The padded row count ``sharding.tp_shard`` takes for ``spec`` at degree ``tp``: vocab-split parameters
    are padded (megatron's rule), every other kind is split as it is (None)."""
    return padded_vocab_size(spec.shape[0], tp, vocab_divisible_by) if spec.kind is ShardKind.VOCAB else None


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
    _cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, repr=False, compare=False)

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
        return [list(b.transfers) for b in pair_buckets(self.transfers, max_bytes)]

    def wire_transfers(self, max_bytes: int, bytes_per_element: int | None = None) -> list[Transfer]:
        """``transfers`` sized at ``bytes_per_element`` (the dtype on the wire) and split along their units so
        that none exceeds ``max_bytes`` unless a single unit does."""
        bpe = bytes_per_element or self.bytes_per_element
        out: list[Transfer] = []
        for t in self.transfers:
            unit_bytes = self.specs[t.param].elements_per_unit * bpe
            out += split_transfer(
                replace(t, num_bytes=(t.stop - t.start) * unit_bytes), unit_bytes, max_bytes
            )
        return out

    def rounds(
        self, bucket_bytes: int, max_inflight_bytes: int, bytes_per_element: int | None = None
    ) -> tuple[tuple[Bucket, ...], ...]:
        """The global message schedule (identical on every rank; see :func:`schedule_rounds`), memoised."""
        key = ("rounds", bucket_bytes, max_inflight_bytes, bytes_per_element or self.bytes_per_element)

        def build() -> tuple[tuple[Bucket, ...], ...]:
            buckets = pair_buckets(self.wire_transfers(bucket_bytes, bytes_per_element), bucket_bytes)
            return tuple(tuple(r) for r in schedule_rounds(buckets, max_inflight_bytes))

        return self.cached(key, build)

    def cached(self, key: tuple[Any, ...], build: Callable[[], T]) -> T:
        """``build()`` once per ``key``: derived schedules (and the executor's copy tables) are reused on every
        weight sync. Valid because a plan is never mutated after :func:`build_plan` returns it."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@dataclass(frozen=True)
class Bucket:
    """Transfers of one (src, dst) pair sent as one flat message, in this order."""

    src: int
    dst: int
    transfers: tuple[Transfer, ...]
    num_bytes: int


def split_transfer(t: Transfer, unit_bytes: int, max_bytes: int) -> list[Transfer]:
    """``t`` cut along its units into pieces of at most ``max_bytes`` (at least one unit each)."""
    step = max(1, max_bytes // unit_bytes)
    return [
        replace(
            t, start=lo, stop=min(lo + step, t.stop), num_bytes=(min(lo + step, t.stop) - lo) * unit_bytes
        )
        for lo in range(t.start, t.stop, step)
    ]


def pair_buckets(transfers: Iterable[Transfer], max_bytes: int) -> list[Bucket]:
    """Transfers grouped per (src, dst) pair, pairs in sorted order, greedily into buckets of at most
    ``max_bytes`` (an item larger than that goes alone)."""
    by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(t.src, t.dst)].append(t)
    out: list[Bucket] = []
    for (src, dst), items in sorted(by_pair.items()):
        bucket: list[Transfer] = []
        size = 0
        for t in items:
            if bucket and size + t.num_bytes > max_bytes:
                out.append(Bucket(src, dst, tuple(bucket), size))
                bucket, size = [], 0
            bucket.append(t)
            size += t.num_bytes
        out.append(Bucket(src, dst, tuple(bucket), size))
    return out


def schedule_rounds(buckets: Sequence[Bucket], max_inflight_bytes: int) -> list[list[Bucket]]:
    """Every bucket assigned to one round such that (a) each (src, dst) pair sends at most one message per
    round, so batched isend/irecv cannot mismatch, and (b) each rank sends plus receives at most
    ``max_inflight_bytes`` per round (a bucket larger than that goes alone for both its ranks).

    First-fit decreasing: buckets by size, largest first (ties in input order), each into the earliest round it
    fits. A pure function of its input, so every rank computes the same schedule and p2p never deadlocks.
    """
    rounds: list[_Round] = []
    for *_, bucket in sorted((-b.num_bytes, i, b) for i, b in enumerate(buckets)):
        target = next((r for r in rounds if r.fits(bucket, max_inflight_bytes)), None)
        if target is None:
            target = _Round()
            rounds.append(target)
        target.add(bucket)
    return [r.buckets for r in rounds]


@dataclass
class _Round:
    buckets: list[Bucket] = field(default_factory=list)
    pairs: set[tuple[int, int]] = field(default_factory=set)
    loads: dict[int, int] = field(default_factory=dict)
    """rank -> bytes it sends plus receives in this round."""

    def fits(self, bucket: Bucket, cap: int) -> bool:
        if (bucket.src, bucket.dst) in self.pairs:
            return False
        for rank in (bucket.src, bucket.dst):
            load = self.loads.get(rank, 0)
            if load + bucket.num_bytes > cap and not (load == 0 and bucket.num_bytes > cap):
                return False
        return True

    def add(self, bucket: Bucket) -> None:
        self.buckets.append(bucket)
        self.pairs.add((bucket.src, bucket.dst))
        for rank in (bucket.src, bucket.dst):
            self.loads[rank] = self.loads.get(rank, 0) + bucket.num_bytes
