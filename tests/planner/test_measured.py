"""The planner against what a real TrainEngine allocates (the self-check, on gloo ranks): parameters per
rank, weight bytes, fp32 gradient buffers and the distributed optimizer's fp32 main params and moments."""

from __future__ import annotations

import dataclasses

from mcore_rl.planner import PlanInput, stage_params
from mcore_rl.planner.selfcheck import RankBytes, check_rank, self_check_reports
from tests.models import tiny_arch

# (family, tp, pp, bf16, ep, etp) on 2 ranks: TP2, DP2 (TP1) in bf16 and fp32, PP2 with tied embeddings;
# Qwen3-MoE (layer 1 dense) at TP2 (SP) x EP2 with ETP1: attention split over TP, the router replicated, each
# rank 2 whole experts of the 4.
LAYOUTS = [
    ("llama", 2, 1, True, 1, None),
    ("llama", 1, 1, True, 1, None),
    ("llama", 1, 1, False, 1, None),
    ("qwen2", 1, 2, True, 1, None),
    ("qwen3_moe", 2, 1, True, 2, 1),
]


def _plan(family: str, tp: int, pp: int, bf16: bool, ep: int = 1, etp: int | None = None) -> PlanInput:
    return PlanInput(
        arch=tiny_arch(family),
        gpu="A100-80",
        world_size=2,
        tp=tp,
        pp=pp,
        sp=tp > 1 and family == "qwen3_moe",
        ep=ep,
        etp=etp,
        seq_length=16,
        bf16=bf16,
    )


def _self_check_all() -> list:
    return [self_check_reports(_plan(*layout))[1] for layout in LAYOUTS]


def test_train_engine_matches_the_planner_at_tp2_dp2_pp2(run_distributed):
    rank0, rank1 = run_distributed(_self_check_all, world_size=2)
    assert rank0 == rank1  # every rank gathers every report
    for layout, reports in zip(LAYOUTS, rank0, strict=True):
        assert all(not problems for _, problems in reports), (layout, reports)
    # DP2 in bf16: each rank holds about half of the 12 B/param optimizer state, all of the rest.
    (a, _), (b, _) = rank0[1]
    params = stage_params(tiny_arch("llama"), _plan("llama", 1, 1, True).layout, 0)
    assert a.params == b.params == params
    assert a.optimizer_bytes + b.optimizer_bytes == 12 * params
    assert abs(a.optimizer_bytes - b.optimizer_bytes) < 0.05 * 12 * params
    # fp32: the main params are the weights themselves, only Adam's two moments are extra.
    (c, _), (d, _) = rank0[2]
    assert c.weights_bytes == 4 * params and c.optimizer_bytes + d.optimizer_bytes == 8 * params
    # PP2 with tied embeddings: the last stage keeps its own copy of the embedding as the output layer.
    stages = {measured.stage: measured.params for measured, _ in rank0[3]}
    assert stages[1] - stages[0] == 64  # the final norm: both stages hold 256 x 64 vocab rows
    # TP2 x EP2, ETP1: each rank holds 2 whole experts of the 4 in each of the 3 MoE layers, 3 x 2 x (3 x 32 x 64)
    # params, whose optimizer state megatron keeps in its own groups over the expert-DP group (edp = 2 / (etp 1 x
    # ep 2) = 1: unsharded, 12 B/param on each rank).
    for measured, _ in rank0[4]:
        assert measured.expert_params == 3 * 2 * 3 * 32 * 64 == 36_864
        assert measured.expert_optimizer_bytes == 12 * 36_864


def test_check_rank_names_each_mismatch():
    plan = _plan("llama", 1, 1, True)
    params = stage_params(plan.arch, plan.layout, 0)
    good = RankBytes(
        stage=0,
        params=params,
        param_tensors=20,
        weights_bytes=2 * params,
        grads_bytes=4 * params + 4 * 64,
        grad_buckets=1,
        optimizer_bytes=6 * params,
    )
    assert check_rank(plan, good, 12 * params) == []
    off_by_one = dataclasses.replace(good, params=params + 1, weights_bytes=2 * params + 2)
    assert check_rank(plan, off_by_one, 12 * params) == [
        f"parameters {params + 1:,} != planned {params:,}",
        f"weight bytes {2 * params + 2:,} != planned {2 * params:,}",
    ]
    unpadded_grads = dataclasses.replace(good, grads_bytes=2 * params)  # bf16 grads would fail here
    assert check_rank(plan, unpadded_grads, 12 * params)[0].startswith("grad bytes")
    assert check_rank(plan, good, 18 * params) == [
        f"optimizer bytes over the DP group {18 * params:,} != planned {12 * params:,}"
    ]
