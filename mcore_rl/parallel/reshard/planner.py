"""Building a :class:`~mcore_rl.parallel.reshard.plan.ReshardPlan`: rollout coordinates, then sources.

Split from ``plan.py`` so the data types read on their own; everything here is pure too.

What the plan cannot serve, each refused by :func:`build_plan` with a :class:`LayoutError` before any rank
moves a byte (every other train layout, tied or not, with PP/VPP/SP/DP, is served; see the hybrid matrix):

- a rollout TP that does not divide the world: "rollout tensor_model_parallel_size=3 must divide world_size=4";
- rollout and training TP that do not nest (neither divides the other): "rollout tensor_model_parallel_size=2 and
  training tensor_model_parallel_size=3 must nest";
- a split dimension that does not divide, e.g. fewer KV heads than rollout TP (KV heads are split, never
  replicated): "decoder.layers.0.self_attention.linear_qkv.weight: 2 query groups cannot be split over
  rollout tensor_model_parallel_size=4".
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from mcore_rl.parallel.layout import LayoutError, ParallelLayout
from mcore_rl.parallel.reshard.naming import holder_stages
from mcore_rl.parallel.reshard.plan import (
    Interval,
    ParamSpec,
    ReshardPlan,
    Transfer,
    holds,
    shard_intervals,
    train_split,
)
from mcore_rl.parallel.sharding import ShardKind


def rollout_coordinates(
    train: ParallelLayout, tp_g: int, consecutive: bool = False
) -> dict[int, tuple[int, int]]:
    """rank -> (rollout tp coord, rollout dp coord), nesting each rollout shard with the rank's train shard.

    ``tp_g = m * tp``: m consecutive train TP groups form one rollout group; train coord t in block b takes
    rollout coord ``t * m + b``, a sub-block of its train shard. ``tp = m * tp_g``: each train TP group splits
    into m rollout groups; train coord t takes ``t // m``, a super-block of its train shard.

    ``consecutive=True`` is the layout engines that build their own groups impose (vLLM: rank r holds TP
    coordinate ``r % tp_g``). It nests too when ``tp_g == tp`` or ``tp == 1`` or ``tp_g == 1``; otherwise the
    plan stays exact and minimal for that assignment but moves more bytes.
    """
    if tp_g < 1 or train.world_size % tp_g:
        raise LayoutError(
            f"rollout tensor_model_parallel_size={tp_g} must divide world_size={train.world_size}"
        )
    tp = train.tp
    if tp_g % tp and tp % tp_g:
        raise LayoutError(
            f"rollout tensor_model_parallel_size={tp_g} and training tensor_model_parallel_size={tp} must nest"
        )
    if consecutive:
        return {r: (r % tp_g, r // tp_g) for r in range(train.world_size)}
    train_groups = train.tp_groups()  # rank order: consecutive ranks
    coords: dict[int, tuple[int, int]] = {}
    if tp_g >= tp:
        m = tp_g // tp
        for g_index, group in enumerate(train_groups):
            block, rollout_group = g_index % m, g_index // m
            for t, rank in enumerate(group):
                coords[rank] = (t * m + block, rollout_group)
    else:
        m = tp // tp_g
        for g_index, group in enumerate(train_groups):
            for t, rank in enumerate(group):
                coords[rank] = (t // m, g_index * m + t % m)
    return coords


def _subtract(needed: list[Interval], owned: list[Interval]) -> list[Interval]:
    out = []
    for seg, lo, hi in needed:
        cuts = sorted((s_lo, s_hi) for s, s_lo, s_hi in owned if s == seg and s_lo < hi and s_hi > lo)
        cursor = lo
        for c_lo, c_hi in cuts:
            if c_lo > cursor:
                out.append((seg, cursor, c_lo))
            cursor = max(cursor, c_hi)
        if cursor < hi:
            out.append((seg, cursor, hi))
    return out


def _intersect(a: Interval, b: Interval) -> Interval | None:
    if a[0] != b[0]:
        return None
    lo, hi = max(a[1], b[1]), min(a[2], b[2])
    return (a[0], lo, hi) if lo < hi else None


def owner_stages(spec: ParamSpec, train: ParallelLayout, num_layers: int, tied: bool) -> set[int]:
    """Stages whose ranks hold ``spec``: the plan's sources (see :func:`naming.holder_stages`)."""
    return holder_stages(spec.name, spec.layer, train, num_layers, tied)


def _pieces(missing: Interval, shards: list[list[Interval]]) -> list[Interval]:
    """Cut ``missing`` at every owner-shard boundary so each piece lies inside whole shards."""
    seg, lo, hi = missing
    cuts = {lo, hi}
    for shard in shards:
        for s, s_lo, s_hi in shard:
            if s == seg:
                cuts.update(c for c in (s_lo, s_hi) if lo < c < hi)
    points = sorted(cuts)
    return [(seg, a, b) for a, b in itertools.pairwise(points)]


def _contains(shard: list[Interval], piece: Interval) -> bool:
    return any(s == piece[0] and lo <= piece[1] and piece[2] <= hi for s, lo, hi in shard)


def _check_divisible(specs: list[ParamSpec], train: ParallelLayout, tp_g: int) -> None:
    for spec in specs:
        if spec.kind in (ShardKind.REPLICATED, ShardKind.VOCAB):
            continue
        training = (
            ("training tensor_model_parallel_size", train.tp)
            if spec.expert is None
            else ("training expert_tensor_parallel_size", train.expert_tp)
        )
        for what, size in (training, ("rollout tensor_model_parallel_size", tp_g)):
            if spec.units_per_segment % size:
                unit = "query groups" if spec.unit_rows > 1 else f"dim-{spec.split_dim} rows"
                raise LayoutError(
                    f"{spec.name}: {spec.units_per_segment} {unit} cannot be split over {what}={size}"
                )


def build_plan(
    specs: list[ParamSpec],
    train: ParallelLayout,
    tp_g: int,
    *,
    num_layers: int,
    tied_embeddings: bool,
    bytes_per_element: int = 4,
    vocab_divisible_by: int = 128,
    rollout_vocab_divisible_by: int | None = None,
    consecutive_rollout_ranks: bool = False,
) -> ReshardPlan:
    """The zero-redundancy plan; each piece comes from the owner that has sent the fewest bytes so far.

    ``vocab_divisible_by`` is the training side's megatron vocab padding (per TP rank multiple); the rollout
    side may pad differently (vLLM pads the whole vocab to 64, i.e. ``64 // tp_g`` in these units).

    Rollout TP groups come out of ``ReshardPlan.rollout_groups`` ordered by rollout TP coordinate; an engine
    must get exactly that order as its group ranks (``ParallelContext.subgroup`` keeps it). With
    ``tp_g > tp > 1`` the nested coordinates are not in rank order, and a group that sorts its ranks (torch's
    default) would silently give ranks the wrong shards.
    """
    rollout_div = vocab_divisible_by if rollout_vocab_divisible_by is None else rollout_vocab_divisible_by
    if vocab_divisible_by < 1 or rollout_div < 1:  # 0 stood for the training side's 128 in silence
        raise ValueError(
            f"vocab padding multiples must be >= 1, got {vocab_divisible_by} (training) and {rollout_div} (rollout)"
        )
    coords = rollout_coordinates(train, tp_g, consecutive_rollout_ranks)  # first: the layout-level errors
    _check_divisible(specs, train, tp_g)
    sent: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    local: dict[int, list[tuple[str, Interval]]] = defaultdict(list)
    for spec in specs:
        stages = owner_stages(spec, train, num_layers, tied_embeddings)
        owners = {
            r: shard_intervals(spec, *train_split(train, spec, r), vocab_divisible_by)
            for r in range(train.world_size)
            if train.coords(r).pp in stages and holds(train, spec, r)
        }
        for rank in range(train.world_size):
            needed = shard_intervals(spec, tp_g, coords[rank][0], rollout_div)
            owned = owners.get(rank, [])
            local[rank] += [(spec.name, k) for p in needed for o in owned if (k := _intersect(p, o))]
            for missing in _subtract(needed, owned):
                for piece in _pieces(missing, list(owners.values())):
                    src = min(
                        (r for r, shard in owners.items() if _contains(shard, piece)),
                        key=lambda r: (sent[r], r),
                    )
                    size = (piece[2] - piece[1]) * spec.elements_per_unit * bytes_per_element
                    sent[src] += size
                    transfers.append(Transfer(spec.name, piece[0], piece[1], piece[2], src, rank, size))
    return ReshardPlan(
        train=train,
        tp_g=tp_g,
        rollout_coords=coords,
        specs={s.name: s for s in specs},
        transfers=transfers,
        local_copies=dict(local),
        bytes_per_element=bytes_per_element,
        train_vocab_divisible_by=vocab_divisible_by,
        rollout_vocab_divisible_by=rollout_div,
    )
