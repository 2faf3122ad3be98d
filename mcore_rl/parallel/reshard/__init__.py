"""3D-HybridEngine weight resharding: a pure plan (``plan``, ``planner``) and its executor."""

from mcore_rl.parallel.reshard.plan import (
    ParamSpec,
    ReshardPlan,
    Transfer,
    arch_param_specs,
    model_param_specs,
    shard_intervals,
)
from mcore_rl.parallel.reshard.planner import build_plan, rollout_coordinates

__all__ = [
    "ParamSpec",
    "ReshardPlan",
    "Transfer",
    "arch_param_specs",
    "build_plan",
    "model_param_specs",
    "rollout_coordinates",
    "shard_intervals",
]
