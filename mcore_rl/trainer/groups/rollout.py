"""The driver's handle on a rollout pool of its own (``rollout.colocate=false``; the ranks are
:class:`~mcore_rl.engine.workers.rollout.RolloutWorker`). The ordering the ``submit_*`` methods rely on is
stated in that module's docstring."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_rl.controller.backend import Backend
from mcore_rl.controller.dispatch import num_rollout_shards
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.workers.memory import max_over_ranks
from mcore_rl.trainer.groups.actor import ActorGroup, submit_rollout
from mcore_rl.types import RolloutBatch, RolloutRequest


class RolloutGroup:
    """The driver's handle on a rollout pool: whole requests in, whole batches out (see the module docstring
    for the ordering the ``submit_*`` methods rely on)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.num_rollout_shards = num_rollout_shards(backend.infos)

    def submit_generate(self, request: RolloutRequest, params: SamplingParams) -> Callable[[], RolloutBatch]:
        """Start sampling (prompts split over replicas); call the result for the samples in prompt order."""
        return submit_rollout(self.backend, request, params)

    def generate(self, request: RolloutRequest, params: SamplingParams) -> RolloutBatch:
        return self.submit_generate(request, params)()

    def submit_load_weights(self, full: dict[str, torch.Tensor]) -> Callable[[], None]:
        """Start loading a full (TP=1) state into every rank (sent once, not once per rank). Runs after every
        call submitted before it."""
        wait = self.backend.submit_shared("load_full_state", full)

        def loaded() -> None:
            wait()

        return loaded

    def load_weights(self, full: dict[str, torch.Tensor]) -> None:
        self.submit_load_weights(full)()

    def submit_load_weights_from(self, actors: ActorGroup) -> Callable[[], None]:
        """Start taking the actor's current weights (``HybridWorker.full_state``, which leaves the actor in
        its TRAIN phase): actor rank 0's gather goes to the pool's ranks without passing through the driver.
        The actor's calls submitted later run after the gather; the wait also surfaces the actor's errors."""
        return actors.backend.submit_relay("full_state", self.backend, "load_full_state")

    def load_weights_from(self, actors: ActorGroup) -> None:
        self.submit_load_weights_from(actors)()

    def phase_memory(self) -> dict[str, float]:
        """Peak memory per phase (generate, sync) since the last call, the maximum over the pool's ranks."""
        return max_over_ranks(self.backend.submit("take_phase_memory", None, "")())

    def shutdown(self) -> None:
        self.backend.shutdown()
