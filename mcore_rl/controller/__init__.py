"""The single controller's thin layer over Ray: resource pools, worker groups, explicit dispatch."""

from mcore_rl.controller.dispatch import (
    RankInfo,
    concat_records,
    data_owners,
    rollout_owners,
    row_slices,
    split_record,
)
from mcore_rl.controller.resources import RayConfig, ResourcePool, available_cpus, init_ray
from mcore_rl.controller.worker_group import Pending, WorkerError, WorkerGroup
from mcore_rl.engine.workers.base import Worker

__all__ = [
    "Pending",
    "RankInfo",
    "RayConfig",
    "ResourcePool",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "available_cpus",
    "concat_records",
    "data_owners",
    "init_ray",
    "rollout_owners",
    "row_slices",
    "split_record",
]
