"""Where a step's rollouts come from and how the updated weights reach them: the actor's own engines
(:class:`ColocatedRollout`, HybridFlow's colocated placement) or a rollout pool of its own
(:class:`PoolRollout`, ``rollout.colocate=false``). The step is built with one of them and never asks which.

Ordering is the backends', not locks': a rank runs its calls one at a time in submission order
(``controller/backend.py``). Both sources rely on it. The colocated sync is submitted right behind the update
and runs after it on every actor rank; the pool's weight load is submitted behind the generation already
queued on the pool (one-step-off), so that generation samples the weights it was started with and the next
one samples the loaded ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.trainer.groups.rollout import RolloutGroup
from mcore_rl.trainer.multi_turn import GroupTurns
from mcore_rl.types import RolloutBatch, RolloutRequest

SyncAndMemory = Callable[[], tuple[dict[str, float], dict[str, float]]]
"""A wait for (the weight sync's timings, the step's per-phase memory peaks, max over ranks)."""


class RolloutSource(Protocol):
    """The rollout engines of a step and their weights."""

    def submit_generate(self, request: RolloutRequest, params: SamplingParams) -> Callable[[], RolloutBatch]:
        """Start sampling ``request``; the result waits for the samples in prompt order."""
        ...

    def turns(self, num_conversations: int) -> GroupTurns:
        """The engines as a token-in/token-out engine for one multi-turn rollout of ``num_conversations``."""
        ...

    def submit_sync_and_memory(self, generation_pending: bool) -> SyncAndMemory:
        """Start giving the engines the actor's weights as the last submitted update leaves them, then
        reading the step's memory peaks. ``generation_pending``: a generation of the next step's rollout is
        queued on the engines (one-step-off); it keeps the weights it was started with."""
        ...

    def sync(self) -> dict[str, float]:
        """The actor's current weights into the engines, now (after SFT, on resume)."""
        ...

    def close(self) -> None:
        """Stop what the source owns beyond the actor group (a pool's workers)."""
        ...


class ColocatedRollout:
    """The actor's colocated engines, synced by the hybrid engine's reshard (TRAIN -> ROLLOUT)."""

    def __init__(self, actors: ActorGroup) -> None:
        self.actors = actors

    def submit_generate(self, request: RolloutRequest, params: SamplingParams) -> Callable[[], RolloutBatch]:
        rollout = self.actors.generate(request, params)  # the engines are the actor's: sample now
        return lambda: rollout

    def turns(self, num_conversations: int) -> GroupTurns:
        return GroupTurns(self.actors.backend, num_conversations)

    def submit_sync_and_memory(self, generation_pending: bool) -> SyncAndMemory:
        # Queued right behind the update (an actor runs its calls in order): no driver round trip between.
        sync, memory = self.actors.submit_sync_weights(), self.actors.submit_phase_memory()
        return lambda: (sync(), memory())

    def sync(self) -> dict[str, float]:
        return self.actors.sync_weights()

    def close(self) -> None:
        """Nothing of its own: the engines go with the actor group."""


class PoolRollout:
    """A rollout pool sent the actor's full weights after each update (verl's one-step-off placement)."""

    def __init__(self, pool: RolloutGroup, actors: ActorGroup) -> None:
        self.pool = pool
        self.actors = actors
        self._loading: Callable[[], None] | None = None
        """The weights sent after the last update while a generation was pending: queued behind it on the
        pool, awaited at the next sync."""

    def submit_generate(self, request: RolloutRequest, params: SamplingParams) -> Callable[[], RolloutBatch]:
        return self.pool.submit_generate(request, params)

    def turns(self, num_conversations: int) -> GroupTurns:
        return GroupTurns(self.pool.backend, num_conversations)

    def submit_sync_and_memory(self, generation_pending: bool) -> SyncAndMemory:
        # The pool's sync starts when awaited (after the update's wait); the memory read follows the actor's
        # gather for it, so the gather counts in this step's phases.
        return lambda: (self._send(generation_pending), self.actors.phase_memory())

    def sync(self) -> dict[str, float]:
        return self._send(generation_pending=False)

    def _send(self, generation_pending: bool) -> dict[str, float]:
        """Actor rank 0 gathers; its result goes to the pool's ranks without passing through the driver. With
        a generation pending the load queues behind it and the driver goes on."""
        start = time.perf_counter()
        if self._loading is not None:
            self._loading()
        waited = time.perf_counter()
        loading, self._loading = self.pool.submit_load_weights_from(self.actors), None
        if generation_pending:
            self._loading = loading
        else:
            loading()  # the next step generates right away, from these weights
        return {"time/sync_wait_last_s": waited - start, "time/sync_send_s": time.perf_counter() - waited}

    def close(self) -> None:
        self.pool.shutdown()
