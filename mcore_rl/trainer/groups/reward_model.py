"""The driver's handle on the reward model ranks (forward only, colocated with the actor)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.controller.dispatch import data_owners, num_dp_shards, split_record
from mcore_rl.engine.workers.reward_model import RewardModelSpec, is_model_checkpoint
from mcore_rl.types import RolloutBatch


class RewardModelGroup:
    """The driver's handle on the reward model ranks (colocated with the actor)."""

    def __init__(self, backend: Any, spec: RewardModelSpec) -> None:
        self.backend = backend
        self.num_dp_shards = num_dp_shards(backend.infos)
        self._data_owners = data_owners(backend.infos)
        backend.submit("build_reward_model", None, "", spec)()

    def submit_scores(self, batch: RolloutBatch, micro_batch_size: int) -> Callable[[], torch.Tensor]:
        """Start scoring (the driver runs the rules meanwhile); call the result to wait for [N] scores."""
        shards = list(split_record(batch, self.num_dp_shards))
        micro = min(micro_batch_size, shards[0].num_sequences)
        wait = self.backend.submit("reward_model_scores", shards, "dp", micro)
        return lambda: torch.cat([wait()[i] for i in self._data_owners])


def reward_model_checkpoint(path: str, run_dir: str) -> str:
    """``path`` when it is a converted checkpoint; else its conversion into ``run_dir/reward_model``, read
    once by the driver, so that every rank then reads only its own shards (at any layout)."""
    if is_model_checkpoint(path):
        return path
    from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_in_this_process

    out = os.path.join(run_dir, "reward_model")
    return convert_in_this_process(HfToMcoreOptions(path, out, overwrite=True))
