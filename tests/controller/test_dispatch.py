"""Dispatch is pure: row splits, record split/concat, and which rank owns each shard, for real layouts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mcore_rl.controller.dispatch import (
    RankInfo,
    concat_records,
    data_owners,
    rollout_owners,
    row_slices,
    shard_of_rank,
    split_record,
)
from mcore_rl.controller.resources import available_cpus
from mcore_rl.parallel.layout import ParallelLayout

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Rec:
    tokens: torch.Tensor  # [N, S]
    ids: list[int]  # [N]
    temperature: float


def _infos(world: int, tp: int, pp: int) -> list[RankInfo]:
    layout = ParallelLayout(world_size=world, tp=tp, pp=pp)
    out = []
    for rank in range(world):
        c = layout.coords(rank)
        out.append(
            RankInfo(
                rank, c.dp, c.tp, c.pp, c.pp == pp - 1, rollout_replica=rank // 2, rollout_tp_rank=rank % 2
            )
        )
    return out


def test_row_slices_are_contiguous_and_refuse_uneven_splits() -> None:
    assert row_slices(6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="prompts: 7 rows do not split evenly over 2 ranks"):
        row_slices(7, 2, "prompts")


def test_split_then_concat_round_trips_tensors_and_lists() -> None:
    rec = _Rec(torch.arange(12).view(6, 2), list(range(10, 16)), 0.7)
    shards = split_record(rec, 3)
    assert [s.ids for s in shards] == [[10, 11], [12, 13], [14, 15]]
    assert shards[1].tokens.tolist() == [[4, 5], [6, 7]] and shards[2].temperature == 0.7
    back = concat_records(shards)
    assert torch.equal(back.tokens, rec.tokens) and back.ids == rec.ids


def test_concat_refuses_shards_that_disagree_on_a_scalar_field() -> None:
    a, b = _Rec(torch.zeros(1, 2), [0], 1.0), _Rec(torch.zeros(1, 2), [1], 0.5)
    with pytest.raises(ValueError, match=r"_Rec.temperature differs"):
        concat_records([a, b])


def test_split_refuses_row_fields_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="disagree on the row count"):
        split_record(_Rec(torch.zeros(4, 2), [1, 2, 3], 1.0), 2)


def test_owners_are_last_stage_tp0_per_dp_rank() -> None:
    infos = _infos(8, tp=2, pp=2)  # dp = 2
    owners = data_owners(infos)
    assert len(owners) == 2
    for dp, index in enumerate(owners):
        info = infos[index]
        assert (info.dp_rank, info.tp_rank, info.pp_rank) == (dp, 0, 1)
    assert shard_of_rank(infos, "dp") == [i.dp_rank for i in infos]
    assert rollout_owners(infos) == [0, 2, 4, 6]  # rollout TP2: replica r's rank 0 is global rank 2r


def test_owners_need_one_owner_per_shard() -> None:
    broken = [RankInfo(0, 0, 0, 0, True), RankInfo(1, 2, 0, 0, True)]  # dp rank 1 has no owner
    with pytest.raises(ValueError, match="training dp shard needs exactly one owner"):
        data_owners(broken)


def test_two_ranks_claiming_one_shard_are_refused() -> None:
    # both would compute the shard and one result would silently replace the other
    twice = [RankInfo(0, 0, 0, 0, True, rollout_replica=0), RankInfo(1, 0, 0, 0, True, rollout_replica=0)]
    with pytest.raises(
        ValueError, match=r"rollout replica needs exactly one owner rank, got owners of \[0, 0\]"
    ):
        rollout_owners(twice)
    with pytest.raises(
        ValueError, match=r"training dp shard needs exactly one owner rank, got owners of \[0, 0\]"
    ):
        data_owners(twice)


def test_a_rollout_pool_is_replicas_of_rollout_tp_whatever_the_actors_meshes() -> None:
    """A CP2 (or EP2) actor's pool of two TP1 ranks is two replicas: the pool kept the actor's CP, which made
    both ranks one replica, each sampling the whole batch."""
    from mcore_rl.config import load_config
    from mcore_rl.trainer.build import rollout_pool_parallel

    recipe = str(REPO / "recipes" / "demo_cpu.yaml")
    overrides = ["parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=1"]
    cfg = load_config(recipe, [*overrides, "rollout.colocate=false", "rollout.num_ranks=2"], rules=False)
    layout = rollout_pool_parallel(cfg).layout(2)
    assert [layout.coords(rank).dp for rank in range(2)] == [0, 1]


def test_available_cpus_prefers_slurm_then_affinity() -> None:
    assert available_cpus({"SLURM_CPUS_ON_NODE": "48"}) == 48
    import os

    assert available_cpus({}) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="SLURM_CPUS_ON_NODE must be an integer"):
        available_cpus({"SLURM_CPUS_ON_NODE": "lots"})
