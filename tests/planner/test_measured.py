"""The planner against what a real TrainEngine allocates: parameters per rank, weight bytes, fp32 gradient
buffers and the distributed optimizer's fp32 main params and Adam moments, in bf16 on gloo ranks."""

from __future__ import annotations

import math

import torch

from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.train_engine import OptimizerConfig, TrainEngine
from mcore_rl.parallel.context import ParallelConfig, ParallelContext
from mcore_rl.planner import PlanInput, stage_params, train_state
from tests.models import tiny_arch

# (family, tensor_parallel_size, pipeline_parallel_size) on 2 ranks: TP2, DP2 (TP1) and PP2 (tied embedding).
LAYOUTS = [("llama", 2, 1), ("llama", 1, 1), ("qwen2", 1, 2)]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure_one(family: str, tp: int, pp: int) -> dict:
    arch = tiny_arch(family)
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    with ParallelContext.initialize(config) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(dtype=torch.bfloat16), OptimizerConfig(lr=1e-3))
        engine.zero_grad()
        engine.step()  # Adam creates its moments on the first step
        params = [p for model in engine.models for p in model.parameters()]
        buffers = [buffer for chunk in engine.chunks for buffer in chunk.buffers]
        optimizer = 0
        for opt in engine.optimizers:
            for group in opt.optimizer.param_groups:
                for main_param in group["params"]:  # the fp32 main-param shards
                    state = opt.optimizer.state.get(main_param, {})
                    moments = [v for k, v in state.items() if k != "step"]
                    optimizer += _tensor_bytes([main_param, *moments])
        return {
            "stage": ctx.pp_rank,
            "tp_rank": ctx.tp_rank,
            "dp": ctx.dp_size,
            "params": sum(p.numel() for p in params),
            "param_tensors": len(params),
            "weights": _tensor_bytes(params),
            "grads": _tensor_bytes(b.grad_data for b in buffers),
            "buckets": sum(len(b.buckets) for b in buffers),
            "optimizer": optimizer,
        }


def _measure_all() -> list[dict]:
    return [_measure_one(*layout) for layout in LAYOUTS]


def test_planner_matches_train_engine_tensor_bytes(run_distributed):
    ranks = run_distributed(_measure_all, world_size=2)
    for index, (family, tp, pp) in enumerate(LAYOUTS):
        arch = tiny_arch(family)
        plan = PlanInput(
            arch=arch, gpu="A100-80", world_size=2, tp=tp, pp=pp, seq_length=16, global_batch_size=2
        )
        measured = [rank[index] for rank in ranks]
        for rank in measured:
            expected_params = stage_params(arch, plan.layout, rank["stage"])
            assert rank["params"] == expected_params, (family, tp, pp)
            assert rank["weights"] == 2 * expected_params  # bf16
            # megatron pads each parameter's start to 64 elements and each bucket's end to lcm(dp, 128).
            padding = 64 * rank["param_tensors"] + math.lcm(rank["dp"], 128) * rank["buckets"]
            assert 0 <= rank["grads"] - 4 * expected_params <= 4 * padding
        # Optimizer: 12 B per parameter split over one DP group (the padding holds no state).
        for stage, tp_rank in {(rank["stage"], rank["tp_rank"]) for rank in measured}:
            shards = [rank for rank in measured if (rank["stage"], rank["tp_rank"]) == (stage, tp_rank)]
            planned = train_state(plan).optimizer_bytes if pp == 1 else None
            total = sum(rank["optimizer"] for rank in shards)
            assert total == 12 * stage_params(arch, plan.layout, stage)
            if planned is not None:
                # Each DP shard holds its slice of the padded buffer: within the padding of 12 B / dp each.
                for rank in shards:
                    assert abs(rank["optimizer"] - planned) <= 12 * padding
