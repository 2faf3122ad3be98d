"""The plan executed over gloo: every rank ends with exactly its rollout shards, moving the planned bytes,
within the memory bound, with the same bits whether the native pack kernel or its reference runs."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from mcore_rl.ops import _native, pack_copy, unpack_copy
from mcore_rl.parallel.config import HybridConfig
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.parallel.reshard import build_plan, execution_schedule, model_param_specs, padded_rows
from mcore_rl.parallel.reshard.executor import execute_plan
from mcore_rl.parallel.reshard.planner import owner_stages
from mcore_rl.parallel.sharding import tp_shard
from tests.parallel.test_reshard_plan import ARCH


def _setup(world: int, rank: int, tp: int, pp: int, tp_g: int):
    """(plan, full tensors, this rank's training shards) for the test model."""
    train = ParallelLayout(world, tp=tp, pp=pp)
    specs = model_param_specs(**ARCH, tie_word_embeddings=False)
    plan = build_plan(specs, train, tp_g, num_layers=ARCH["num_layers"], tied_embeddings=False)
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    me = train.coords(rank)
    local = {
        s.name: tp_shard(full[s.name], s.kind, me.tp, tp, padded_rows(s, tp))
        for s in specs
        if me.pp in owner_stages(s, train, ARCH["num_layers"], tied=False)
    }
    return plan, full, local


def _mismatched(plan, full, out, rank: int, dtype: torch.dtype) -> list[str]:
    coord = plan.rollout_coords[rank][0]
    return [
        name
        for name, spec in plan.specs.items()
        if not torch.equal(
            out[name],
            tp_shard(full[name], spec.kind, coord, plan.tp_g, padded_rows(spec, plan.tp_g)).to(dtype),
        )
    ]


def _reshard(
    tp: int, pp: int, tp_g: int, bucket_bytes: int, dtype: torch.dtype, max_inflight_bytes: int | None = None
) -> dict:
    rank = dist.get_rank()
    plan, full, local = _setup(dist.get_world_size(), rank, tp, pp, tp_g)
    out, stats = execute_plan(
        plan, local, dtype=dtype, bucket_bytes=bucket_bytes, max_inflight_bytes=max_inflight_bytes
    )
    again, _ = execute_plan(  # the memoised schedule gives the same result
        plan, local, dtype=dtype, bucket_bytes=bucket_bytes, max_inflight_bytes=max_inflight_bytes
    )
    return {
        "mismatched": _mismatched(plan, full, out, rank, dtype),
        "repeat_differs": [n for n in out if not torch.equal(out[n], again[n])],
        "received": stats.bytes_received,
        "planned": plan.received_bytes()[rank] // 4 * dtype.itemsize,
        "peak": stats.peak_buffer_bytes,
        "largest_unit": max(s.elements_per_unit for s in plan.specs.values()) * dtype.itemsize,
        "num_rounds": len(
            execution_schedule(
                plan,
                rank,
                bucket_bytes=bucket_bytes,
                max_inflight_bytes=max_inflight_bytes,
                bytes_per_element=dtype.itemsize,
            ).rounds
        ),
        "split": len(plan.wire_transfers(bucket_bytes, dtype.itemsize)) > len(plan.transfers),
    }


@pytest.mark.parametrize(
    ("world_size", "tp", "pp", "tp_g", "bucket_bytes"),
    [
        (2, 1, 2, 2, 1 << 20),
        (2, 2, 1, 1, 4096),
        (4, 2, 2, 1, 1 << 20),
        (4, 2, 2, 4, 2048),
        (4, 1, 2, 2, 1 << 20),
    ],
)
def test_execute_plan_builds_rollout_shards(run_distributed, world_size, tp, pp, tp_g, bucket_bytes):
    for result in run_distributed(_reshard, tp, pp, tp_g, bucket_bytes, torch.float32, world_size=world_size):
        assert result["mismatched"] == [] and result["repeat_differs"] == []
        assert result["received"] == result["planned"]
        assert result["peak"] <= 2 * bucket_bytes


def test_execute_plan_casts_to_bf16_in_flight(run_distributed):
    for result in run_distributed(_reshard, 2, 1, 1, 1 << 20, torch.bfloat16):
        assert result["mismatched"] == []
        assert result["received"] == result["planned"]


def _kept_whole(dtype: torch.dtype) -> dict:
    rank = dist.get_rank()
    plan, full, local = _setup(dist.get_world_size(), rank, 2, 1, 2)
    local = {name: shard.contiguous() for name, shard in local.items()}  # as an engine's parameters are
    out, _ = execute_plan(plan, local, dtype=dtype)
    return {
        "mismatched": _mismatched(plan, full, out, rank, dtype),
        "aliased": sorted(n for n in out if n in local and out[n].data_ptr() == local[n].data_ptr()),
        "same_shape": sorted(n for n in out if n in local and out[n].shape == local[n].shape),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shard_kept_whole_is_handed_over_without_a_copy(run_distributed, dtype):
    """TP -> the same TP_g: every rank keeps its training shards; in their dtype they are returned as they
    are (the rollout engine's load copies them anyway), cast ones and the vocab shards as new tensors."""
    for result in run_distributed(_kept_whole, dtype, world_size=2):
        assert result["mismatched"] == []
        if dtype == torch.float32:
            # a vocab shard holding padding rows copies its real rows only (the rollout's padding is zero)
            vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
            assert set(result["aliased"]) <= set(result["same_shape"])
            assert {n for n in result["same_shape"] if n not in vocab} <= set(result["aliased"])
        else:
            assert result["aliased"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_buckets_split_transfers_and_bound_the_memory_in_flight(run_distributed, dtype):
    """Messages of at most 512 bytes (smaller than most transfers), 1 KiB in flight: many rounds."""
    results = run_distributed(_reshard, 2, 2, 4, 512, dtype, 1024, world_size=4)
    for result in results:
        assert result["largest_unit"] <= 512  # so the bound below holds without exception
        assert result["split"] and result["num_rounds"] >= 10
        assert result["mismatched"] == [] and result["repeat_differs"] == []
        assert result["received"] == result["planned"]
        assert 0 < result["peak"] <= 1024


def _native_vs_reference(tp: int, pp: int, tp_g: int, dtype: torch.dtype) -> dict:
    rank = dist.get_rank()
    plan, full, local = _setup(dist.get_world_size(), rank, tp, pp, tp_g)
    native, _ = execute_plan(plan, local, dtype=dtype, bucket_bytes=1024)
    previous = os.environ.get("MCORE_RL_FORCE_REFERENCE")
    os.environ["MCORE_RL_FORCE_REFERENCE"] = "1"
    try:
        reference, _ = execute_plan(plan, local, dtype=dtype, bucket_bytes=1024)
    finally:
        if previous is None:
            del os.environ["MCORE_RL_FORCE_REFERENCE"]
        else:
            os.environ["MCORE_RL_FORCE_REFERENCE"] = previous
    return {
        "native": _native.native_available(),
        "differs": [n for n in native if not torch.equal(native[n], reference[n])],
        "mismatched": _mismatched(plan, full, reference, rank, dtype),
    }


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C not built: only the reference exists")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_and_reference_reshard_identically(run_distributed, dtype):
    for result in run_distributed(_native_vs_reference, 2, 2, 2, dtype, world_size=4):
        assert result["native"]
        assert result["differs"] == [] and result["mismatched"] == []


@pytest.mark.parametrize(
    ("world", "tp", "pp", "tp_g"), [(4, 2, 2, 1), (4, 2, 2, 4), (4, 1, 2, 2), (8, 2, 2, 2)]
)
def test_schedules_of_all_ranks_fit_together(world, tp, pp, tp_g):
    """Without processes: run every rank's tables in one process, handing each pair's messages over in
    order (as p2p does), and get every rank's rollout shards; each rank's staging stays within the cap."""
    plans = {r: _setup(world, r, tp, pp, tp_g) for r in range(world)}
    for _, _, local in plans.values():  # tp_shard gives views; the kernels need contiguous memory
        local.update({name: tensor.contiguous() for name, tensor in local.items()})
    schedules = {
        r: execution_schedule(plans[r][0], r, bucket_bytes=256, max_inflight_bytes=768) for r in range(world)
    }
    wire: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for rank, schedule in schedules.items():
        assert schedule.staging_numel * 4 <= 768 or schedule.staging_numel * 4 == max(
            m.numel * 4 for messages in schedule.rounds for m in messages
        )
        local = plans[rank][2]
        for m in (m for messages in schedule.rounds for m in messages if m.send):
            buffer = torch.empty(m.numel)
            pack_copy([local[n] for n in m.names], m.table, buffer)
            wire[(rank, m.peer)].append(buffer)
    for rank, schedule in schedules.items():
        plan, full, local = plans[rank]
        out = {
            n: torch.zeros_like(
                tp_shard(full[n], s.kind, plan.rollout_coords[rank][0], tp_g, padded_rows(s, tp_g))
            )
            for n, s in plan.specs.items()
        }
        for name, table in schedule.local_copies:
            pack_copy([local[name]], table, out[name])
        for m in (m for messages in schedule.rounds for m in messages if not m.send):
            buffer = wire[(m.peer, rank)].pop(0)
            assert buffer.numel() == m.numel
            unpack_copy(buffer, m.table, [out[n] for n in m.names])
        assert _mismatched(plan, full, out, rank, torch.float32) == []
    assert all(not queue for queue in wire.values())


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match=r"rollout\.hybrid\.max_inflight_bytes=0 must be > 0 or null"):
        HybridConfig(max_inflight_bytes=0)
    plan, _, _ = _setup(2, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="max_inflight_bytes must be positive"):
        execution_schedule(plan, 0, max_inflight_bytes=-1)
