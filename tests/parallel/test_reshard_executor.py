"""The plan executed over gloo: every rank ends with exactly its rollout shards, moving the planned bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size
from mcore_rl.parallel.reshard import build_plan, model_param_specs
from mcore_rl.parallel.reshard.executor import execute_plan
from mcore_rl.parallel.reshard.planner import owner_stages
from mcore_rl.parallel.sharding import ShardKind, tp_shard
from tests.parallel.test_reshard_plan import ARCH


def _padded(spec, tp):
    return padded_vocab_size(spec.shape[0], tp) if spec.kind is ShardKind.VOCAB else None


def _reshard(tp: int, pp: int, tp_g: int, bucket_bytes: int, dtype: torch.dtype) -> dict:
    world = dist.get_world_size()
    train = ParallelLayout(world, tp=tp, pp=pp)
    specs = model_param_specs(**ARCH, tie_word_embeddings=False)
    plan = build_plan(specs, train, tp_g, num_layers=ARCH["num_layers"], tied_embeddings=False)
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    me = train.coords(dist.get_rank())
    local = {
        s.name: tp_shard(full[s.name], s.kind, me.tp, tp, _padded(s, tp))
        for s in specs
        if me.pp in owner_stages(s, train, ARCH["num_layers"], tied=False)
    }
    out, stats = execute_plan(plan, local, dtype=dtype, bucket_bytes=bucket_bytes)
    coord = plan.rollout_coords[dist.get_rank()][0]
    mismatched = [
        s.name
        for s in specs
        if not torch.equal(
            out[s.name], tp_shard(full[s.name], s.kind, coord, tp_g, _padded(s, tp_g)).to(dtype)
        )
    ]
    planned = plan.received_bytes()[dist.get_rank()] // 4 * torch.finfo(dtype).bits // 8
    return {
        "mismatched": mismatched,
        "received": stats.bytes_received,
        "planned": planned,
        "peak": stats.peak_buffer_bytes,
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
        assert result["mismatched"] == []
        assert result["received"] == result["planned"]


def test_execute_plan_casts_to_bf16_in_flight(run_distributed):
    for result in run_distributed(_reshard, 2, 1, 1, 1 << 20, torch.bfloat16):
        assert result["mismatched"] == []
        assert result["received"] == result["planned"]
