"""ReshardPlan on many layouts, without processes: coverage, minimality, no foreign data, and a data-level check
that applying the plan to real shards yields exactly the rollout shards."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from mcore_rl.parallel.layout import LayoutError, ParallelLayout
from mcore_rl.parallel.reshard import (
    Bucket,
    Transfer,
    build_plan,
    model_param_specs,
    padded_rows,
    rollout_coordinates,
    schedule_rounds,
    shard_intervals,
    split_transfer,
)
from mcore_rl.parallel.reshard.plan import local_units, shard_view
from mcore_rl.parallel.sharding import ShardKind, tp_shard

ARCH = dict(
    vocab_size=250,
    hidden_size=16,
    ffn_hidden_size=24,
    num_layers=4,
    num_attention_heads=8,
    num_query_groups=4,
    head_dim=2,
    qkv_bias=True,
)
# (world, tp, pp, vpp, tp_g)
LAYOUTS = [
    (2, 1, 2, None, 1),
    (2, 1, 2, None, 2),
    (2, 2, 1, None, 1),
    (2, 2, 1, None, 2),
    (4, 2, 2, None, 1),
    (4, 2, 2, None, 2),
    (4, 2, 2, None, 4),
    (4, 2, 1, None, 1),
    (4, 2, 1, None, 4),
    (8, 2, 2, None, 4),
    (8, 4, 2, None, 2),
    (8, 1, 4, None, 2),
    (8, 2, 2, 2, 2),
    (8, 1, 2, 2, 4),
    (16, 4, 4, None, 4),
]


def _plan(world, tp, pp, vpp, tp_g, tied, **kwargs):
    train = ParallelLayout(world, tp=tp, pp=pp, vpp=vpp)
    specs = model_param_specs(**ARCH, tie_word_embeddings=tied)
    plan = build_plan(specs, train, tp_g, num_layers=ARCH["num_layers"], tied_embeddings=tied, **kwargs)
    return plan, specs


def _units(intervals):
    return {(s, u) for s, lo, hi in intervals for u in range(lo, hi)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "w{}-tp{}-pp{}-vpp{}-tpg{}".format(*v))
@pytest.mark.parametrize("vllm_like", [False, True], ids=["nested", "vllm"])
def test_plan_covers_exactly_and_moves_the_minimum(layout, tied, vllm_like):
    kwargs = (
        {"consecutive_rollout_ranks": True, "rollout_vocab_divisible_by": 64 // layout[4]}
        if vllm_like
        else {}
    )
    plan, specs = _plan(*layout, tied, **kwargs)
    div = plan.rollout_vocab_divisible_by
    train = plan.train
    received = defaultdict(lambda: defaultdict(list))
    for t in plan.transfers:
        spec = plan.specs[t.param]
        assert t.src != t.dst
        src = train.coords(t.src)
        src_shard = shard_intervals(spec, train.tp, src.tp)
        assert any(
            s == t.segment and lo <= t.start and t.stop <= hi for s, lo, hi in src_shard
        )  # sender owns it
        received[t.dst][t.param].append((t.segment, t.start, t.stop))
    minimum = {}
    for rank in range(train.world_size):
        need_bytes = 0
        for spec in specs:
            needed = _units(shard_intervals(spec, plan.tp_g, plan.rollout_coords[rank][0], div))
            kept = _units([iv for name, iv in plan.local_copies.get(rank, []) if name == spec.name])
            got_list = [u for iv in received[rank][spec.name] for u in _units([iv])]
            got = set(got_list)
            assert len(got_list) == len(got), "a unit arrives twice"
            assert not (kept & got), "a unit is both kept and received"
            assert kept | got == needed, f"{spec.name} on rank {rank} not covered exactly"
            need_bytes += len(needed - kept) * spec.elements_per_unit * 4
        minimum[rank] = need_bytes
    assert plan.received_bytes() == minimum


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "w{}-tp{}-pp{}-vpp{}-tpg{}".format(*v))
def test_rollout_shards_nest_with_train_shards(layout):
    plan, specs = _plan(*layout, tied=False)
    groups = plan.rollout_groups()
    assert sorted(r for g in groups for r in g) == list(range(plan.train.world_size))
    assert all(len(g) == plan.tp_g for g in groups)
    for rank, (tp_coord, _) in plan.rollout_coords.items():
        train_tp = plan.train.coords(rank).tp
        for spec in specs:
            if spec.kind in (ShardKind.REPLICATED, ShardKind.VOCAB):
                continue
            rollout = _units(shard_intervals(spec, plan.tp_g, tp_coord))
            train = _units(shard_intervals(spec, plan.train.tp, train_tp))
            assert rollout <= train or train <= rollout


def test_consecutive_ranks_nest_when_tp_g_equals_tp_and_cost_more_otherwise():
    def layer_bytes(plan):  # vocab rows follow megatron's padding, which need not nest; layers do
        return sum(t.num_bytes for t in plan.transfers if plan.specs[t.param].layer is not None)

    nested, _ = _plan(8, 2, 2, None, 4, tied=False)
    vllm, _ = _plan(8, 2, 2, None, 4, tied=False, consecutive_rollout_ranks=True)
    assert layer_bytes(vllm) > layer_bytes(nested)
    same, _ = _plan(8, 2, 2, None, 2, tied=False, consecutive_rollout_ranks=True)
    reference, _ = _plan(8, 2, 2, None, 2, tied=False)
    assert same.received_bytes() == reference.received_bytes()


def test_senders_are_balanced_over_replicas():
    plan, _ = _plan(8, 1, 2, None, 2, tied=False)  # dp=4 replicas of each stage
    sent = [b for b in plan.sent_bytes().values() if b]
    assert len(sent) == 8 and max(sent) <= 1.5 * min(sent)


@pytest.mark.parametrize(
    "layout", [(4, 2, 2, None, 1), (4, 2, 2, None, 4), (8, 2, 2, 2, 2), (4, 1, 2, None, 2)]
)
@pytest.mark.parametrize("tied", [False, True])
def test_applying_the_plan_to_real_shards_gives_the_rollout_shards(layout, tied):
    """Simulate every rank in one process: megatron train shards in, megatron-layout rollout shards out."""
    plan, specs = _plan(*layout, tied)
    train = plan.train
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    train_shards = {
        r: {
            s.name: tp_shard(full[s.name], s.kind, train.coords(r).tp, train.tp, padded_rows(s, train.tp))
            for s in specs
        }
        for r in range(train.world_size)
    }
    for rank in range(train.world_size):
        coord = plan.rollout_coords[rank][0]
        out = {
            s.name: torch.zeros_like(
                tp_shard(full[s.name], s.kind, coord, plan.tp_g, padded_rows(s, plan.tp_g))
            )
            for s in specs
        }
        pieces = [(name, iv, rank) for name, iv in plan.local_copies.get(rank, [])]
        pieces += [(t.param, (t.segment, t.start, t.stop), t.src) for t in plan.transfers if t.dst == rank]
        for name, interval, src in pieces:
            spec, n = plan.specs[name], interval[2] - interval[1]
            src_tp = 0 if spec.kind is ShardKind.REPLICATED else train.coords(src).tp
            src_tp_size = 1 if spec.kind is ShardKind.REPLICATED else train.tp
            dst_tp, dst_tp_size = (0, 1) if spec.kind is ShardKind.REPLICATED else (coord, plan.tp_g)
            data = shard_view(
                spec, train_shards[src][name], local_units(spec, src_tp_size, src_tp, interval), n
            )
            shard_view(spec, out[name], local_units(spec, dst_tp_size, dst_tp, interval), n).copy_(data)
        for spec in specs:
            expected = tp_shard(full[spec.name], spec.kind, coord, plan.tp_g, padded_rows(spec, plan.tp_g))
            assert torch.equal(out[spec.name], expected), (rank, spec.name)


def test_buckets_respect_the_size_limit_and_keep_every_transfer():
    plan, _ = _plan(4, 2, 2, None, 1, tied=False)
    buckets = plan.buckets(max_bytes=2048)
    assert sum(len(b) for b in buckets) == len(plan.transfers)
    for bucket in buckets:
        assert len({(t.src, t.dst) for t in bucket}) == 1
        assert len(bucket) == 1 or sum(t.num_bytes for t in bucket) <= 2048


def test_sizes_that_do_not_split_name_the_parameter():
    specs = model_param_specs(
        **{**ARCH, "num_query_groups": 2, "num_attention_heads": 4}, tie_word_embeddings=False
    )
    with pytest.raises(
        LayoutError,
        match=r"linear_qkv\.weight: 2 query groups cannot be split over rollout tensor_model_parallel_size=4",
    ):
        build_plan(specs, ParallelLayout(4, tp=2), 4, num_layers=4, tied_embeddings=False)


def test_a_zero_vocab_multiple_is_refused():
    """A rollout multiple of 0 stood for the training side's 128 in silence."""
    specs = model_param_specs(**ARCH, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"vocab padding multiples must be >= 1, got 128 \(training\) and 0"):
        build_plan(
            specs,
            ParallelLayout(2, tp=2),
            2,
            num_layers=4,
            tied_embeddings=False,
            rollout_vocab_divisible_by=0,
        )


def test_layouts_that_do_not_nest_are_refused():
    with pytest.raises(LayoutError, match="must nest"):
        rollout_coordinates(ParallelLayout(6, tp=2), 3)
    with pytest.raises(LayoutError, match="must divide world_size=4"):
        rollout_coordinates(ParallelLayout(4, tp=2), 8)


def _units_of(transfers):
    """(param, segment, src, dst, unit) for every unit the transfers move."""
    return sorted((t.param, t.segment, t.src, t.dst, u) for t in transfers for u in range(t.start, t.stop))


@pytest.mark.parametrize(
    "layout",
    [(2, 2, 1, None, 1), (4, 2, 2, None, 1), (4, 2, 2, None, 4), (8, 1, 2, 2, 4), (16, 4, 4, None, 4)],
)
@pytest.mark.parametrize(
    ("bucket_bytes", "max_inflight_bytes", "bytes_per_element"),
    [(512, 1024, 4), (1024, 1024, 2), (300, 4096, 4), (2048, 1000, 4)],
)
def test_round_schedule_moves_every_byte_once_within_the_limits(
    layout, bucket_bytes, max_inflight_bytes, bytes_per_element
):
    plan, _ = _plan(*layout, tied=False)
    rounds = plan.rounds(bucket_bytes, max_inflight_bytes, bytes_per_element)
    buckets = [b for r in rounds for b in r]
    sent = [t for b in buckets for t in b.transfers]
    assert _units_of(sent) == _units_of(plan.transfers)  # every unit exactly once, from the planned sender
    assert sum(b.num_bytes for b in buckets) == sum(plan.received_bytes().values()) * bytes_per_element // 4
    for b in buckets:
        unit_bytes = max(plan.specs[t.param].elements_per_unit * bytes_per_element for t in b.transfers)
        assert {(t.src, t.dst) for t in b.transfers} == {(b.src, b.dst)}
        assert b.num_bytes == sum(t.num_bytes for t in b.transfers)
        single_unit = len(b.transfers) == 1 and b.transfers[0].stop - b.transfers[0].start == 1
        assert b.num_bytes <= bucket_bytes or (single_unit and unit_bytes > bucket_bytes)
    for r in rounds:
        pairs = [(b.src, b.dst) for b in r]
        assert len(pairs) == len(set(pairs)), "a pair sends twice in one round"
        for rank in range(plan.train.world_size):
            mine = [b.num_bytes for b in r if rank in (b.src, b.dst)]
            assert sum(mine) <= max_inflight_bytes or len(mine) == 1, (rank, mine)
    # Pure and rank-independent: rebuilding from scratch gives the same schedule.
    again, _ = _plan(*layout, tied=False)
    assert again.rounds(bucket_bytes, max_inflight_bytes, bytes_per_element) == rounds


def test_split_transfer_cuts_along_units():
    t = Transfer("w", 1, 3, 13, src=0, dst=1, num_bytes=10 * 48)
    pieces = split_transfer(t, unit_bytes=48, max_bytes=100)
    assert [(p.start, p.stop, p.num_bytes) for p in pieces] == [
        (3, 5, 96),
        (5, 7, 96),
        (7, 9, 96),
        (9, 11, 96),
        (11, 13, 96),
    ]
    assert split_transfer(t, unit_bytes=48, max_bytes=10) == [
        Transfer("w", 1, u, u + 1, 0, 1, 48) for u in range(3, 13)
    ]  # a unit larger than the limit still goes, alone
    assert split_transfer(t, unit_bytes=48, max_bytes=1 << 20) == [t]


def test_schedule_rounds_separates_pairs_and_caps_each_rank():
    def bucket(src, dst, num_bytes):
        return Bucket(src, dst, (Transfer("w", 0, 0, 1, src, dst, num_bytes),), num_bytes)

    a, b, c, d = bucket(0, 1, 60), bucket(0, 1, 40), bucket(2, 0, 50), bucket(3, 2, 300)
    rounds = schedule_rounds([a, b, c, d], max_inflight_bytes=100)
    # d is over the cap: alone for ranks 3 and 2. a and b share a pair: different rounds. c fits next to b
    # on rank 0 (50 + 40 <= 100) but not next to a (60 + 50 > 100), and not next to d on rank 2.
    assert rounds == [[d, a], [c, b]]


class _MoE:
    """A duck-typed ``MoESpec``: 4 experts of 12 on layers 0, 2 and 3 (layer 1 dense)."""

    num_experts, ffn_hidden_size, layers = 4, 12, (0, 2, 3)


# (world, tp, pp, ep, etp, tp_g); TP > 1 with MoE needs SP
MOE_LAYOUTS = [
    (2, 1, 1, 2, None, 1),
    (2, 1, 1, 2, None, 2),
    (4, 2, 1, 2, None, 1),
    (4, 2, 1, 2, None, 4),
    (4, 2, 1, 2, 1, 2),
    (4, 1, 2, 2, None, 2),
    (8, 2, 2, 2, 1, 4),
    (8, 1, 1, 4, None, 2),
]


def _moe_plan(world, tp, pp, ep, etp, tp_g, **kwargs):
    train = ParallelLayout(world, tp=tp, pp=pp, sp=tp > 1, ep=ep, etp=etp)
    specs = model_param_specs(**ARCH, tie_word_embeddings=False, moe=_MoE())
    return build_plan(
        specs, train, tp_g, num_layers=ARCH["num_layers"], tied_embeddings=False, **kwargs
    ), specs


def _train_shard(spec, train, rank):
    if spec.expert is None:
        return train.tp, train.coords(rank).tp
    return train.expert_tp, train.expert_coords(rank).etp


@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=lambda v: "w{}-tp{}-pp{}-ep{}-etp{}-tpg{}".format(*v))
@pytest.mark.parametrize("vllm_like", [False, True], ids=["nested", "vllm"])
def test_moe_plan_covers_exactly_and_moves_the_minimum(layout, vllm_like):
    kwargs = {"consecutive_rollout_ranks": True} if vllm_like else {}
    plan, specs = _moe_plan(*layout, **kwargs)
    train = plan.train
    assert sum(s.expert is not None for s in specs) == 3 * 4 * 2  # 3 MoE layers x 4 experts x (fc1, fc2)
    received = defaultdict(lambda: defaultdict(list))
    for t in plan.transfers:
        spec = plan.specs[t.param]
        if spec.expert is not None:  # only a rank of the EP block holding the expert sends it
            assert spec.expert in train.local_experts(t.src, 4)
        size, coord = _train_shard(spec, train, t.src)
        assert any(
            s == t.segment and lo <= t.start and t.stop <= hi
            for s, lo, hi in shard_intervals(spec, size, coord)
        )
        received[t.dst][t.param].append((t.segment, t.start, t.stop))
    minimum = {}
    for rank in range(train.world_size):
        need = 0
        for spec in specs:
            needed = _units(shard_intervals(spec, plan.tp_g, plan.rollout_coords[rank][0]))
            kept = _units([iv for name, iv in plan.local_copies.get(rank, []) if name == spec.name])
            got = [u for iv in received[rank][spec.name] for u in _units([iv])]
            assert len(got) == len(set(got)) and not (kept & set(got))
            assert kept | set(got) == needed, f"{spec.name} on rank {rank} not covered exactly"
            need += len(needed - kept) * spec.elements_per_unit * 4
        minimum[rank] = need
    assert plan.received_bytes() == minimum
    # minimal: a rank keeps every unit it needs and holds (its own experts' slices included)
    for rank in range(train.world_size):
        stage = {i for chunk in train.stage_layers(ARCH["num_layers"])[train.coords(rank).pp] for i in chunk}
        for spec in specs:
            holder = spec.expert is None or spec.expert in train.local_experts(rank, 4)
            on_stage = spec.layer in stage if spec.layer is not None else True
            owned = (
                _units(shard_intervals(spec, *_train_shard(spec, train, rank)))
                if holder and on_stage
                else set()
            )
            if spec.layer is None:  # embedding / output layer: their own stage rules (tested above)
                continue
            needed = _units(shard_intervals(spec, plan.tp_g, plan.rollout_coords[rank][0]))
            kept = _units([iv for name, iv in plan.local_copies.get(rank, []) if name == spec.name])
            assert kept == needed & owned, (rank, spec.name)


@pytest.mark.parametrize(
    "layout", [(4, 2, 1, 2, None, 1), (4, 2, 1, 2, 1, 2), (8, 2, 2, 2, 1, 4), (4, 1, 2, 2, None, 2)]
)
def test_applying_the_moe_plan_to_real_shards_gives_the_rollout_shards(layout):
    plan, specs = _moe_plan(*layout)
    train = plan.train
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}

    def shard(spec, size, coord):
        return tp_shard(full[spec.name], spec.kind, coord, size, padded_rows(spec, size))

    for rank in range(train.world_size):
        coord = plan.rollout_coords[rank][0]
        out = {s.name: torch.zeros_like(shard(s, plan.tp_g, coord)) for s in specs}
        pieces = [(name, iv, rank) for name, iv in plan.local_copies.get(rank, [])]
        pieces += [(t.param, (t.segment, t.start, t.stop), t.src) for t in plan.transfers if t.dst == rank]
        for name, interval, src in pieces:
            spec, n = plan.specs[name], interval[2] - interval[1]
            size, src_coord = (1, 0) if spec.kind is ShardKind.REPLICATED else _train_shard(spec, train, src)
            if spec.expert is not None:
                assert spec.expert in train.local_experts(src, 4)  # data only from a holder
            dst_size, dst_coord = (1, 0) if spec.kind is ShardKind.REPLICATED else (plan.tp_g, coord)
            data = shard_view(
                spec, shard(spec, size, src_coord), local_units(spec, size, src_coord, interval), n
            )
            shard_view(spec, out[name], local_units(spec, dst_size, dst_coord, interval), n).copy_(data)
        for spec in specs:
            assert torch.equal(out[spec.name], shard(spec, plan.tp_g, coord)), (rank, spec.name)
