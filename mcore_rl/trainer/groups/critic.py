"""The driver's handle on the critic ranks: whole batches in, whole batches out (see ``groups/actor.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.controller.dispatch import data_owners, num_dp_shards, split_record
from mcore_rl.engine.workers.critic import CriticSpec
from mcore_rl.types import CriticStats, RolloutBatch, ValueBatch


class CriticGroup:
    """The driver's handle on the critic ranks (a backend over workers that are :class:`CriticHost`).

    ``actors`` is the actor group's backend when the critic lives on its own pool (its body then comes from
    the actor through the driver); None when colocated (the copy stays inside each process)."""

    def __init__(self, backend: Any, actors: Any = None) -> None:
        self.backend = backend
        self.actors = actors
        self.num_dp_shards = num_dp_shards(backend.infos)
        self._data_owners = data_owners(backend.infos)

    def build(self, spec: CriticSpec) -> None:
        self.backend.submit("build_critic", None, "", spec)()

    def init_from_actor(self) -> None:
        """The actor's current weights into the critic body; the head is kept."""
        if self.actors is None:
            self.backend.submit("critic_init_from_actor", None, "")()
            return
        full = next(s for s in self.actors.submit("full_state", None, "")() if s is not None)
        self.actors.submit("sync_weights", None, "")()  # the actor back to ROLLOUT for the next step
        self.backend.submit("critic_load_body", None, "", full)()

    def save(self, run_checkpoint: str, step: int) -> None:
        """The critic's own checkpoint into ``<run_checkpoint>/critic`` (after the actor's is in place)."""
        self.backend.submit("critic_save", None, "", run_checkpoint, step)()

    def load(self, run_checkpoint: str) -> None:
        self.backend.submit("critic_load", None, "", run_checkpoint)()

    def shutdown(self) -> None:
        """Stop the critic's own pool (a colocated critic goes with the actor group)."""
        if self.actors is not None:
            self.backend.shutdown()

    def submit_values(self, batch: RolloutBatch, micro_batch_size: int) -> Callable[[], torch.Tensor]:
        """Start the value pass (the driver scores meanwhile); call the result to wait for [N, S] values."""
        shards = list(split_record(batch, self.num_dp_shards))
        wait = self.backend.submit(
            "critic_values", shards, "dp", min(micro_batch_size, shards[0].num_sequences)
        )

        def collect() -> torch.Tensor:
            results = wait()
            return torch.cat([results[i] for i in self._data_owners])

        return collect

    def update(
        self, batch: ValueBatch, num_mini_batches: int, ppo_epochs: int, micro_batch_size: int
    ) -> CriticStats:
        return self.submit_update(batch, num_mini_batches, ppo_epochs, micro_batch_size)()

    def submit_update(
        self, batch: ValueBatch, num_mini_batches: int, ppo_epochs: int, micro_batch_size: int
    ) -> Callable[[], CriticStats]:
        """Start the critic's update (on its own pool it runs beside the actor's); call the result to wait."""
        shards = list(split_record(batch, self.num_dp_shards))
        micro = min(micro_batch_size, max(shards[0].tokens.shape[0] // num_mini_batches, 1))
        wait = self.backend.submit("critic_update", shards, "dp", num_mini_batches, ppo_epochs, micro)

        def collect() -> CriticStats:
            stats: CriticStats = wait()[self._data_owners[0]]
            return stats

        return collect
