"""3D-HybridEngine weight resharding: a pure plan and schedule (``plan``, ``planner``) and its executor."""

from mcore_rl.parallel.reshard.executor import (
    ExecutionSchedule,
    ReshardStats,
    execute_plan,
    execution_schedule,
)
from mcore_rl.parallel.reshard.plan import (
    Bucket,
    ParamSpec,
    ReshardPlan,
    Transfer,
    arch_param_specs,
    model_param_specs,
    padded_rows,
    pair_buckets,
    schedule_rounds,
    shard_intervals,
    split_transfer,
)
from mcore_rl.parallel.reshard.planner import build_plan, rollout_coordinates

__all__ = [
    "Bucket",
    "ExecutionSchedule",
    "ParamSpec",
    "ReshardPlan",
    "ReshardStats",
    "Transfer",
    "arch_param_specs",
    "build_plan",
    "execute_plan",
    "execution_schedule",
    "model_param_specs",
    "padded_rows",
    "pair_buckets",
    "rollout_coordinates",
    "schedule_rounds",
    "shard_intervals",
    "split_transfer",
]
