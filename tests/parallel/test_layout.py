"""Pure rank arithmetic: no processes."""

from __future__ import annotations

import itertools

import pytest

from mcore_rl.parallel.layout import LayoutError, ParallelLayout, RankCoords, padded_vocab_size

LAYOUTS = [
    ParallelLayout(8, tp=2, pp=2),
    ParallelLayout(8, tp=4, pp=1),
    ParallelLayout(16, tp=2, pp=4, vpp=2),
    ParallelLayout(6, tp=3, pp=1),
    ParallelLayout(1),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_coords_round_trip_and_cover_the_grid(layout):
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        assert layout.rank(coords) == rank
        seen.add((coords.tp, coords.dp, coords.pp))
    assert seen == set(itertools.product(range(layout.tp), range(layout.dp), range(layout.pp)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_groups_partition_the_world(layout):
    for groups, size in (
        (layout.tp_groups(), layout.tp),
        (layout.dp_groups(), layout.dp),
        (layout.pp_groups(), layout.pp),
        (layout.model_parallel_groups(), layout.tp * layout.pp),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size))
        assert all(len(g) == size for g in groups)


def test_megatron_order_worked_example():
    # tp fastest, then dp, then pp (megatron's default order "tp-cp-ep-dp-pp").
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == RankCoords(tp=1, dp=0, pp=1)


def test_interleaved_stage_layers_follow_megatron():
    # megatron's docstring: pp=4, vpp=2, 16 layers -> GPU0 holds layers [1, 2] and [9, 10] (1-based).
    layout = ParallelLayout(4, pp=4, vpp=2)
    stages = layout.stage_layers(16)
    assert [list(r) for r in stages[0]] == [[0, 1], [8, 9]]
    assert [list(r) for r in stages[3]] == [[6, 7], [14, 15]]
    assert ParallelLayout(2, pp=2).stage_layers(4) == [[range(0, 2)], [range(2, 4)]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 8, "tp": 3}, "world_size=8 is not divisible by tp*pp=3*1"),
        ({"world_size": 8, "tp": 2, "pp": 3}, "tp*pp=2*3"),
        ({"world_size": 4, "tp": 0}, "tp must be a positive integer"),
        ({"world_size": 4, "vpp": 2}, "needs pipeline_model_parallel_size >= 2"),
        ({"world_size": 4, "sp": True}, "sequence_parallel=True needs tensor_model_parallel_size >= 2"),
    ],
)
def test_bad_sizes_name_the_field(kwargs, message):
    with pytest.raises(LayoutError, match=message.replace("*", r"\*")):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_attention_heads": 6, "num_query_groups": 2, "num_layers": 4}, "num_attention_heads=6"),
        ({"num_attention_heads": 8, "num_query_groups": 2, "num_layers": 4}, "num_key_value_heads=2"),
        (
            {"num_attention_heads": 8, "num_query_groups": 4, "num_layers": 6},
            "num_layers=6 is not divisible by pipeline",
        ),
        (
            {
                "num_attention_heads": 8,
                "num_query_groups": 4,
                "num_layers": 4,
                "vocab_size": 99,
                "pad_vocab": False,
            },
            "vocab_size=99",
        ),
        (
            {"num_attention_heads": 8, "num_query_groups": 4, "num_layers": 4, "seq_length": 33},
            "sequence length 33",
        ),
    ],
)
def test_model_that_does_not_split_is_named(kwargs, message):
    layout = ParallelLayout(16, tp=4, pp=4, sp=True)
    with pytest.raises(LayoutError, match=message):
        layout.check_model(**kwargs)


def test_model_that_splits_passes_and_vpp_counts_chunks():
    ParallelLayout(8, tp=2, pp=2).check_model(
        num_attention_heads=8, num_query_groups=2, num_layers=4, vocab_size=99
    )
    with pytest.raises(
        LayoutError, match="pipeline_model_parallel_size\\*virtual_pipeline_model_parallel_size=4"
    ):
        ParallelLayout(4, pp=2, vpp=2).check_model(num_attention_heads=4, num_query_groups=4, num_layers=6)


def test_padded_vocab_size():
    assert padded_vocab_size(250, 1) == 256
    assert padded_vocab_size(250, 2) == 256
    assert padded_vocab_size(257, 2) == 512
    assert padded_vocab_size(32000, 8) == 32768
    assert padded_vocab_size(128256, 4, divisible_by=128) == 128512


def test_expert_mesh_is_megatrons_worked_example():
    # 8 ranks, TP2 x DP4 for the dense weights; experts at ETP1 x EP4 x EDP2 (EP folded into DP).
    layout = ParallelLayout(8, tp=2, sp=True, ep=4, etp=1)
    assert layout.expert_dp == 2
    assert layout.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.expert_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.expert_tp_groups() == [[r] for r in range(8)]
    assert layout.local_experts(5, num_experts=8) == range(2, 4)
    # ETP defaults to TP: expert shards follow the dense TP split
    default = ParallelLayout(8, tp=2, sp=True, ep=2)
    assert default.expert_tp_groups() == default.tp_groups()
    assert default.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(8, tp=2, ep=4, etp=1), ParallelLayout(8, tp=2, pp=2, ep=2), ParallelLayout(4, ep=4)],
)
def test_expert_coords_round_trip_and_groups_partition(layout):
    for rank in range(layout.world_size):
        assert layout.expert_rank(layout.expert_coords(rank)) == rank
        assert layout.expert_coords(rank).pp == layout.coords(rank).pp  # the same pipeline stages
    for groups in (layout.ep_groups(), layout.expert_tp_groups(), layout.expert_dp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "ep": 3}, "expert_tensor_parallel_size\\*expert_model_parallel_size=1\\*3"),
        ({"world_size": 4, "tp": 2, "ep": 4}, "=2\\*4 must divide the 4 ranks"),
        ({"world_size": 4, "ep": 0}, "ep must be a positive integer"),
    ],
)
def test_bad_expert_sizes_name_the_field(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize(
    ("layout", "kwargs", "message"),
    [
        (
            ParallelLayout(4, ep=4),
            {"num_experts": 6},
            "num_experts=6 is not divisible by expert_model_parallel",
        ),
        (ParallelLayout(4, ep=2), {}, "the model has no experts"),
        (
            ParallelLayout(4, tp=2, etp=2, sp=True),
            {"num_experts": 4, "moe_ffn_hidden_size": 33},
            "moe_intermediate_size=33",
        ),
        (ParallelLayout(4, tp=2), {"num_experts": 4}, "needs sequence_parallel=true"),
        (
            ParallelLayout(4, tp=2, etp=1, sp=True),
            {"num_experts": 4},
            "expert_tensor_parallel_size=1 differs",
        ),
    ],
)
def test_moe_model_that_does_not_split_is_named(layout, kwargs, message):
    with pytest.raises(LayoutError, match=message):
        layout.check_model(num_attention_heads=4, num_query_groups=2, num_layers=2, **kwargs)
