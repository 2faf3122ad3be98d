"""Context parallelism in the pure layout: megatron's ``tp-cp-ep-dp-pp`` order, its groups and its rules."""

from __future__ import annotations

import itertools

import pytest

from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.layout import LayoutError, ParallelLayout, RankCoords
from mcore_rl.parallel.reshard import build_plan, model_param_specs, shard_intervals

LAYOUTS = [
    ParallelLayout(16, tp=2, pp=2, cp=2),
    ParallelLayout(8, cp=4),
    ParallelLayout(8, tp=2, cp=2, sp=True),
    ParallelLayout(12, tp=1, pp=2, cp=3),
]


def test_megatron_order_worked_example():
    # 16 ranks: TP2 fastest, then CP2, then DP2, then PP2 (megatron's RankGenerator, order tp-cp-ep-dp-pp)
    layout = ParallelLayout(16, tp=2, pp=2, cp=2)
    assert layout.dp == 2
    assert layout.tp_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert layout.cp_groups()[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.pp_groups()[:3] == [[0, 8], [1, 9], [2, 10]]
    assert layout.model_parallel_groups()[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert layout.coords(6) == RankCoords(tp=0, dp=1, pp=0, cp=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_coords_round_trip_and_groups_partition(layout):
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank(c) == rank
        seen.add((c.tp, c.cp, c.dp, c.pp))
    sizes = (layout.tp, layout.cp, layout.dp, layout.pp)
    assert seen == set(itertools.product(*(range(n) for n in sizes)))
    for groups, size in (
        (layout.tp_groups(), layout.tp),
        (layout.cp_groups(), layout.cp),
        (layout.dp_groups(), layout.dp),
        (layout.dp_cp_groups(), layout.dp * layout.cp),
        (layout.pp_groups(), layout.pp),
    ):
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        assert all(len(g) == size for g in groups)
    # the CP ranks of a group hold the same weights: same TP shard and stage
    for group in layout.cp_groups():
        assert len({(layout.coords(r).tp, layout.coords(r).pp, layout.coords(r).dp) for r in group}) == 1


def test_cp1_is_the_old_layout():
    # the same rank arithmetic as before context parallelism existed (rank = tp + tp * (dp + dp * pp))
    layout = ParallelLayout(8, tp=2, pp=2)
    assert all(layout.coords(r).cp == 0 for r in range(8))
    assert layout.dp_cp_groups() == layout.dp_groups()
    assert layout.sequence_multiple == 1


def test_sequence_multiple_counts_chunks_and_sequence_parallelism():
    assert ParallelLayout(4, cp=2).sequence_multiple == 4
    assert ParallelLayout(8, cp=4).sequence_multiple == 8
    assert ParallelLayout(8, tp=2, cp=2, sp=True).sequence_multiple == 8
    assert ParallelLayout(4, tp=2, cp=2).sequence_multiple == 4  # no SP: TP ranks hold every token


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "cp": 3}, "context_parallel_size=3 does not divide world_size / \\(tp\\*pp\\)"),
        ({"world_size": 8, "tp": 2, "pp": 2, "cp": 4}, "context_parallel_size=4 does not divide"),
        ({"world_size": 4, "cp": 0}, "cp must be a positive integer"),
    ],
)
def test_bad_sizes_name_the_field(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs)


def test_config_field_builds_the_layout_and_is_checked():
    assert ParallelConfig(context_parallel_size=2).layout(8).cp == 2
    with pytest.raises(ValueError, match="context_parallel_size"):
        ParallelConfig(context_parallel_size=0)


@pytest.mark.parametrize(
    ("layout", "kwargs", "message"),
    [
        (
            ParallelLayout(4, cp=2),
            {"seq_length": 30},
            "sequence length 30 is not divisible by 2 x context_parallel",
        ),
        (
            ParallelLayout(8, tp=2, cp=2, sp=True),
            {"seq_length": 36},
            "2 x context_parallel_size=2 x tensor_model_parallel_size=2 \\(sequence_parallel\\) = 8",
        ),
        (ParallelLayout(4, cp=2), {"num_experts": 4}, "context_parallel_size=2 with a mixture-of-experts"),
    ],
)
def test_model_that_does_not_split_is_named(layout, kwargs, message):
    with pytest.raises(LayoutError, match=message):
        layout.check_model(num_attention_heads=4, num_query_groups=2, num_layers=2, **kwargs)
    layout.check_model(num_attention_heads=4, num_query_groups=2, num_layers=2, seq_length=32)


@pytest.mark.parametrize(
    ("layout", "tp_g"),
    [
        (ParallelLayout(4, tp=2, cp=2), 1),
        (ParallelLayout(4, tp=2, cp=2), 4),
        (ParallelLayout(8, tp=2, pp=2, cp=2), 2),
    ],
    ids=["tp2-cp2-to-tp1", "tp2-cp2-to-tp4", "tp2-pp2-cp2-to-tp2"],
)
def test_the_weight_sync_plan_covers_every_rollout_shard_under_cp(layout, tp_g):
    # CP shards no weight: the CP ranks of a TP shard are more holders of it, and the reshard plan still gives
    # every rollout rank exactly its shard, each unit once, from a rank that holds it
    specs = model_param_specs(
        vocab_size=250,
        hidden_size=16,
        ffn_hidden_size=24,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=2,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    plan = build_plan(specs, layout, tp_g, num_layers=4, tied_embeddings=False)
    units = lambda intervals: [(s, u) for s, lo, hi in intervals for u in range(lo, hi)]  # noqa: E731
    for rank in range(layout.world_size):
        for spec in specs:
            needed = units(shard_intervals(spec, tp_g, plan.rollout_coords[rank][0]))
            kept = units([iv for name, iv in plan.local_copies.get(rank, []) if name == spec.name])
            moved = [t for t in plan.transfers if t.dst == rank and t.param == spec.name]
            for t in moved:  # the sender holds what it sends
                owned = shard_intervals(spec, layout.tp, layout.coords(t.src).tp)
                assert any(s == t.segment and lo <= t.start and t.stop <= hi for s, lo, hi in owned)
            got = units([(t.segment, t.start, t.stop) for t in moved])
            assert sorted(kept + got) == sorted(needed), (rank, spec.name)
