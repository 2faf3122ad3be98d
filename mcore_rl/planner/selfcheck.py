"""The planner's self-check: build the real training engine at the planned layout and compare what every
rank allocates with what the planner says it will (``mcore-rl plan --self-check``, under torchrun).

Per rank, with random weights and one optimizer step (Adam creates its moments on the first one):

    parameters   exactly the planner's count for the rank's pipeline stage; with expert parallelism also
                 the experts' part (megatron marks them ``allreduce=False``)
    weights      parameters x dtype size, exactly
    gradients    the DDP fp32 grad buffers (dense and expert-parallel ones): the planner's 4 B/param, plus
                 megatron's padding (each parameter's start rounded to 64 elements, each bucket's end to
                 lcm(dp, 128), or lcm(edp, 128) for the expert buffers)
    optimizer    fp32 main params (bf16 only; in fp32 they are views of the weights) and Adam's moments,
                 summed over the rank's DP group: exactly the planner's 12 (bf16) or 8 (fp32) B/param; with
                 EP > 1 the experts' optimizer (its own param groups) summed over the expert-DP group instead
                 (at EP 1 megatron treats experts as dense weights, and edp == dp)

Only tensor bytes are compared (no allocator or activation peak): they are what the formulas claim exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.engine.params import stage_split
from mcore_rl.planner.lora import stage_adapter_params
from mcore_rl.planner.spec import PlanInput


@dataclass(frozen=True)
class RankBytes:
    """What one rank of a built :class:`~mcore_rl.engine.train_engine.TrainEngine` holds."""

    stage: int
    params: int
    param_tensors: int
    weights_bytes: int
    grads_bytes: int
    grad_buckets: int
    optimizer_bytes: int
    """fp32 main params that own their memory, plus every Adam state tensor except the step count."""
    expert_params: int = 0
    """Of :attr:`params`, those megatron reduces over the expert-DP group (experts, with EP > 1)."""
    expert_optimizer_bytes: int = 0
    """Of :attr:`optimizer_bytes`, the expert-parallel param groups'."""


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(opt: Any, weight_storages: set[int]) -> tuple[int, int]:
    """(all, expert-parallel groups') bytes of one megatron optimizer's main params and Adam state."""
    total = expert = 0
    for group in opt.optimizer.param_groups:
        size = 0
        for main_param in group["params"]:
            if main_param.untyped_storage().data_ptr() not in weight_storages:
                size += _tensor_bytes([main_param])
            state = opt.optimizer.state.get(main_param, {})
            size += _tensor_bytes(v for k, v in state.items() if k != "step" and torch.is_tensor(v))
        total += size
        expert += size if group.get("is_expert_parallel") else 0
    return total, expert


def measure_engine(engine: Any) -> RankBytes:
    """Tensor bytes of ``engine``'s weights, grad buffers and optimizer state on this rank."""
    params = [p for model in engine.models for p in model.parameters()]
    buffers = [b for chunk in engine.chunks for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]
    weight_storages = {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
    sizes = [_optimizer_bytes(opt, weight_storages) for opt in engine.optimizers]
    return RankBytes(
        stage=engine.ctx.pp_rank,
        params=sum(p.numel() for p in params),
        param_tensors=len(params),
        weights_bytes=_tensor_bytes(params),
        grads_bytes=_tensor_bytes(b.grad_data for b in buffers),
        grad_buckets=sum(len(b.buckets) for b in buffers),
        optimizer_bytes=sum(total for total, _ in sizes),
        expert_params=sum(p.numel() for p in params if not getattr(p, "allreduce", True)),
        expert_optimizer_bytes=sum(expert for _, expert in sizes),
    )


def check_rank(
    plan: PlanInput, measured: RankBytes, dp_optimizer_bytes: int, edp_expert_optimizer_bytes: int = 0
) -> list[str]:
    """Mismatches between ``measured`` and the planner, one per line. ``dp_optimizer_bytes``: the dense
    optimizer state summed over the rank's DP group; ``edp_expert_optimizer_bytes``: the experts' summed over
    its expert-DP group (0 without expert parallelism, where megatron keeps experts with the dense state)."""
    split = stage_split(plan.arch, plan.layout, measured.stage)
    expected, expert = split.total, (split.expert if plan.ep > 1 else 0)
    adapters = stage_adapter_params(plan.arch, plan.layout, measured.stage, plan.lora_rank, plan.lora_targets)
    trained = adapters if plan.lora_rank else expected  # LoRA: the base has no gradient or optimizer state
    trained_experts = 0 if plan.lora_rank else expert  # LoRA on MoE adapts the attention: experts frozen
    expected += adapters
    weight_size = 2 if plan.bf16 else 4
    bucket_pad = max(math.lcm(plan.dp, 128), math.lcm(plan.expert_dp, 128))
    padding = 64 * measured.param_tensors + bucket_pad * measured.grad_buckets
    per_param = 12 if plan.bf16 else 8
    problems = []
    if measured.params != expected:
        problems.append(f"parameters {measured.params:,} != planned {expected:,}")
    if measured.expert_params != expert:
        problems.append(f"expert-parallel parameters {measured.expert_params:,} != planned {expert:,}")
    if measured.weights_bytes != weight_size * expected:
        problems.append(f"weight bytes {measured.weights_bytes:,} != planned {weight_size * expected:,}")
    if not 0 <= measured.grads_bytes - 4 * trained <= 4 * padding:
        problems.append(
            f"grad bytes {measured.grads_bytes:,} != planned {4 * trained:,} + padding <= {4 * padding:,}"
        )
    dense_optimizer = per_param * (trained - trained_experts)
    if dp_optimizer_bytes != dense_optimizer:
        problems.append(
            f"optimizer bytes over the DP group {dp_optimizer_bytes:,} != planned {dense_optimizer:,}"
        )
    if edp_expert_optimizer_bytes != per_param * trained_experts:
        problems.append(
            f"expert optimizer bytes over the expert-DP group {edp_expert_optimizer_bytes:,} != planned "
            f"{per_param * trained_experts:,}"
        )
    return problems


def self_check_reports(plan: PlanInput) -> tuple[PlanInput, list[tuple[RankBytes, list[str]]]]:
    """Collective (every rank of the launcher's world): build, step, measure, compare. Returns the plan at
    the world's size and every rank's ``(measured, problems)``."""
    from mcore_rl.engine.lora_spec import LoRASpec
    from mcore_rl.engine.model import ModelOptions
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    config = ParallelConfig(
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp,
        sequence_parallel=plan.sp,
        expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.etp,
    )
    with ParallelContext.initialize(config) as ctx:
        plan = plan.with_layout(world_size=ctx.world_size)
        lora = LoRASpec(plan.lora_rank, 2.0 * plan.lora_rank, plan.lora_targets) if plan.lora_rank else None
        options = ModelOptions(dtype=torch.bfloat16 if plan.bf16 else torch.float32, lora=lora)
        optim = OptimConfig(weight_decay=0.0, use_distributed_optimizer=plan.use_distributed_optimizer)
        engine = TrainEngine.build(plan.arch, ctx, options, optim)
        engine.zero_grad()
        engine.step()
        measured = measure_engine(engine)
        dense = torch.tensor([measured.optimizer_bytes - measured.expert_optimizer_bytes], dtype=torch.int64)
        expert = torch.tensor([measured.expert_optimizer_bytes], dtype=torch.int64)
        dist.all_reduce(dense, group=ctx.dp_group)
        dist.all_reduce(expert, group=ctx.expert_dp_group)
        problems = check_rank(plan, measured, int(dense.item()), int(expert.item()))
        reports: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(reports, (measured, problems))
    return plan, reports


def run_self_check(plan: PlanInput) -> int:
    """:func:`self_check_reports`, printed by rank 0; 0 when every rank matches the planner, else 1."""
    plan, reports = self_check_reports(plan)
    if dist.get_rank() == 0:
        _print_report(plan, reports)
    return 0 if all(not problems for _, problems in reports) else 1


def _print_report(plan: PlanInput, reports: list[Any]) -> None:
    experts = f" ep={plan.ep} etp={plan.layout.expert_tp} edp={plan.expert_dp}" if plan.arch.moe else ""
    print(f"self-check: tp={plan.tp} pp={plan.pp} dp={plan.dp}{experts} on {plan.world_size} ranks")
    for rank, (measured, problems) in enumerate(reports):
        verdict = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
        print(
            f"  rank {rank} stage {measured.stage}: {measured.params:,} params, weights {measured.weights_bytes:,} B, "
            f"grads {measured.grads_bytes:,} B, optimizer {measured.optimizer_bytes:,} B -> {verdict}"
        )
