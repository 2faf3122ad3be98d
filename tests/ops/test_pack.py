"""Reshard pack: the block tables reproduce the torch.cat layouts for every tp -> tp_g, with a dtype cast,
and unpack inverts pack."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.ops import PackPlan, _native, pack_copy, reference, unpack_copy

HEADS, HEAD_DIM, HIDDEN, FFN = 8, 4, 12, 24
# (src_tp, dst_tp, num_query_groups): megatron needs num_query_groups % src_tp == 0; 2 -> 8 replicates KV heads.
LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 4, 2), (4, 2, 4), (2, 2, 2), (2, 8, 2)]


def _layer_shards(src_tp: int, groups: int, gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """One transformer layer's megatron TP shards (fp32), keyed like the plan entries."""
    qkv_rows = groups // src_tp * (HEADS // groups + 2) * HEAD_DIM

    def shards(*shape: int) -> list[torch.Tensor]:
        return [torch.randn(*shape, generator=gen) for _ in range(src_tp)]

    return {
        "qkv": shards(qkv_rows, HIDDEN),
        "qkv_bias": shards(qkv_rows),
        "proj": shards(HIDDEN, HEADS * HEAD_DIM // src_tp),
        "fc1": shards(2 * FFN // src_tp, HIDDEN),
        "fc2": shards(HIDDEN, FFN // src_tp),
        "embed": shards(40 // src_tp, HIDDEN),
        "norm": [torch.randn(HIDDEN, generator=gen)],
    }


def _plan(src_tp: int, dst_tp: int, dst_rank: int, groups: int) -> PackPlan:
    plan = PackPlan(src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank)
    plan.add_qkv("qkv", num_heads=HEADS, num_query_groups=groups, head_dim=HEAD_DIM, columns=HIDDEN)
    plan.add_qkv("qkv_bias", num_heads=HEADS, num_query_groups=groups, head_dim=HEAD_DIM, columns=None)
    plan.add_row_parallel("proj", rows=HIDDEN, columns=HEADS * HEAD_DIM)
    plan.add_gated_fc1("fc1", ffn_hidden_size=FFN, columns=HIDDEN)
    plan.add_row_parallel("fc2", rows=HIDDEN, columns=FFN)
    plan.add_column_parallel("embed", rows=40, columns=HIDDEN)
    plan.add_replicated("norm", shape=(HIDDEN,))
    return plan


def _expected(
    shards: dict[str, list[torch.Tensor]], dst_tp: int, r: int, groups: int
) -> dict[str, torch.Tensor]:
    qkv = {
        "num_heads": HEADS,
        "num_query_groups": groups,
        "head_dim": HEAD_DIM,
        "dst_tp": dst_tp,
        "dst_rank": r,
    }
    return {
        "qkv": reference.qkv_to_rollout(shards["qkv"], **qkv),
        "qkv_bias": reference.qkv_to_rollout(shards["qkv_bias"], **qkv),
        "proj": reference.row_parallel_to_rollout(shards["proj"], dst_tp=dst_tp, dst_rank=r),
        "fc1": reference.gated_fc1_to_rollout(shards["fc1"], dst_tp=dst_tp, dst_rank=r),
        "fc2": reference.row_parallel_to_rollout(shards["fc2"], dst_tp=dst_tp, dst_rank=r),
        "embed": reference.column_parallel_to_rollout(shards["embed"], dst_tp=dst_tp, dst_rank=r),
        "norm": shards["norm"][0],
    }


@pytest.mark.parametrize(("src_tp", "dst_tp", "groups"), LAYOUTS)
def test_pack_matches_cat_layout_and_unpack_inverts(impl: str, src_tp: int, dst_tp: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
    shards = _layer_shards(src_tp, groups, gen)
    sources = [t for ts in shards.values() for t in ts]
    restored = [torch.zeros_like(t) for t in sources]
    for r in range(dst_tp):
        plan = _plan(src_tp, dst_tp, r, groups)
        bucket = plan.pack(sources, torch.full((plan.numel,), float("nan"), dtype=torch.bfloat16))
        packed = plan.views(bucket)
        for name, want in _expected(shards, dst_tp, r, groups).items():
            assert torch.equal(packed[name], want.to(torch.bfloat16)), (name, r)
        assert not bucket.isnan().any()  # every element of the bucket was written
        plan.unpack(bucket, restored)
    for got, want in zip(restored, sources, strict=True):  # the ranks together hold every source element
        assert torch.equal(got, want.to(torch.bfloat16).float())


def test_gqa_kv_heads_are_replicated_when_dst_tp_exceeds_groups(impl: str) -> None:
    shards = _layer_shards(2, 2, torch.Generator().manual_seed(0))
    full_k = reference.qkv_to_rollout(
        shards["qkv"], num_heads=HEADS, num_query_groups=2, head_dim=HEAD_DIM, dst_tp=1, dst_rank=0
    )[HEADS * HEAD_DIM :][: 2 * HEAD_DIM]
    for r in range(8):  # 8 ranks, 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1
        plan = PackPlan(src_tp=2, dst_tp=8, dst_rank=r)
        plan.add_qkv("qkv", num_heads=HEADS, num_query_groups=2, head_dim=HEAD_DIM, columns=HIDDEN)
        k = plan.views(plan.pack(shards["qkv"], torch.empty(plan.numel)))["qkv"][HEAD_DIM : 2 * HEAD_DIM]
        assert torch.equal(k, full_k[r // 4 * HEAD_DIM : (r // 4 + 1) * HEAD_DIM])


def test_tables_merge_contiguous_runs() -> None:
    plan = PackPlan(src_tp=2, dst_tp=1, dst_rank=0)
    plan.add_column_parallel("embed", rows=40, columns=HIDDEN)
    plan.add_gated_fc1("fc1", ffn_hidden_size=FFN, columns=HIDDEN)
    # One run per source shard for the embedding; gate_0, gate_1, up_0, up_1 for fc1 (not one block per row).
    assert plan.table().shape == (2 + 4, 7)


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
)
def test_native_pack_equals_reference_with_strided_blocks(
    src_dtype: torch.dtype, dst_dtype: torch.dtype
) -> None:
    if not _native.extension_loaded():
        pytest.skip("mcore_rl._C is not built")
    gen = torch.Generator().manual_seed(1)
    sources = [
        torch.randn(300, 200, generator=gen).to(src_dtype),
        torch.randn(70_000, generator=gen).to(src_dtype),
    ]
    # A strided 2-D block, a long run cut into several parallel pieces, a zero-sized block.
    table = torch.tensor(
        [[0, 5, 100, 37, 200, 0, 40], [1, 3, 1, 69_000, 69_000, 4000, 69_000], [0, 0, 0, 5, 5, 0, 5]]
    )
    out_native, out_ref = torch.zeros(80_000, dtype=dst_dtype), torch.zeros(80_000, dtype=dst_dtype)
    torch.ops.mcore_rl.pack_copy(sources, table, out_native)
    reference.pack_copy(sources, table, out_ref)
    assert torch.equal(out_native, out_ref)
    back_native, back_ref = [torch.zeros_like(s) for s in sources], [torch.zeros_like(s) for s in sources]
    torch.ops.mcore_rl.unpack_copy(out_native, table, back_native)
    reference.unpack_copy(out_ref, table, back_ref)
    assert all(torch.equal(a, b) for a, b in zip(back_native, back_ref, strict=True))


def test_out_of_bounds_table_is_rejected(impl: str) -> None:
    table = torch.tensor([[0, 90, 1, 20, 20, 0, 20]])  # reads source elements 90..109 of 100
    with pytest.raises((ValueError, RuntimeError), match="past the end"):
        pack_copy([torch.zeros(100)], table, torch.zeros(20))
    with pytest.raises((ValueError, RuntimeError), match="past the end"):
        unpack_copy(torch.zeros(20), table, [torch.zeros(100)])


def test_a_table_whose_reach_overflows_is_rejected(impl: str) -> None:
    """(rows - 1) * stride + cols past int64's range wrapped negative and passed the native check, and the
    copy then wrote in front of the output."""
    whole = torch.zeros(24)
    out = whole[4:20]  # what lies in front of it must stay untouched
    table = torch.tensor([[0, 0, 3, 2, 2, 0, 2**62 - 1]])  # packed stride: 2 * (2**62 - 1) + 2 = 2**63
    with pytest.raises((ValueError, RuntimeError), match="past the end"):
        pack_copy([torch.arange(1.0, 7.0)], table, out)
    assert torch.count_nonzero(whole) == 0


def test_pack_rejects_misordered_sources() -> None:
    plan = PackPlan(src_tp=2, dst_tp=1, dst_rank=0)
    plan.add_gated_fc1("fc1", ffn_hidden_size=FFN, columns=HIDDEN)
    with pytest.raises(ValueError, match="fc1: source 1"):
        plan.pack([torch.zeros(FFN, HIDDEN), torch.zeros(3, 3)], torch.empty(plan.numel))


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
def test_opcheck_pack_kernels() -> None:
    sources = [torch.randn(6, 5), torch.randn(7)]
    table = torch.tensor([[0, 1, 3, 4, 5, 0, 4], [1, 0, 1, 7, 7, 12, 7]])
    torch.library.opcheck(
        torch.ops.mcore_rl.pack_copy.default, (sources, table, torch.zeros(19, dtype=torch.bfloat16))
    )
    outs = [torch.zeros(6, 5), torch.zeros(7)]
    torch.library.opcheck(torch.ops.mcore_rl.unpack_copy.default, (torch.randn(19), table, outs))
