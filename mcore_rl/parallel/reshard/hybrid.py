"""The TRAIN <-> ROLLOUT state machine of the 3D-HybridEngine.

One object per rank owns the transitions; each is synchronous and logged, so offloading training state and
waking the rollout engine never overlap (the memory they contend for would otherwise be double-booked):

    TRAIN --to_rollout()--> [offload optimizer state + grad buffers] -> [reshard weights: plan + transport]
                            -> [rollout.wake_up(weights) -> load_weights(stream) -> wake_up(kv_cache)] --> ROLLOUT
    ROLLOUT --to_train()--> [rollout.sleep(level)] -> [restore grad buffers + optimizer state] --> TRAIN

On CPU the offload steps still run (grad buffers really are freed and restored); moving optimizer state to
host memory is a no-op there.

Every step (and :meth:`HybridEngine.generate`) runs in the context's guarded region: if it raises on one
rank, the peers stop within seconds with a :class:`~mcore_rl.parallel.failure.PeerFailureError` that names
that rank, its exception and the step, instead of waiting out the collective timeout in their sends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from mcore_rl.compat import megatron_cpu
from mcore_rl.parallel.config import HybridConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.reshard.executor import ReshardStats, execute_plan
from mcore_rl.parallel.reshard.plan import ReshardPlan

logger = logging.getLogger(__name__)


class Phase(Enum):
    TRAIN = "train"
    ROLLOUT = "rollout"


@dataclass(frozen=True)
class Transition:
    """One logged phase change."""

    source: Phase
    target: Phase
    seconds: float
    steps_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: int = 0
    """Device memory in use after the transition (CUDA allocated, or this process's RSS on CPU)."""
    reshard: ReshardStats | None = None


def _memory_in_use() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


class HybridEngine:
    """Owns a training engine, a rollout engine and the reshard plan between them (per rank)."""

    def __init__(
        self,
        train_engine: Any,
        rollout_engine: Any,
        plan: ReshardPlan,
        local_params: Callable[[], dict[str, torch.Tensor]],
        to_rollout_tensors: Callable[[dict[str, torch.Tensor]], Iterable[tuple[str, torch.Tensor]]],
        config: HybridConfig | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        self.ctx = ctx
        """Guards every step (failure propagation); None runs unguarded (a single process)."""
        self.train_engine = train_engine
        self.rollout_engine = rollout_engine
        self.plan = plan
        self.local_params = local_params
        self._element_size: int | None = None
        """Bytes per element of the parameters the last reshard sent (the training dtype)."""
        self.to_rollout_tensors = to_rollout_tensors
        self.config = config or HybridConfig()
        self.phase = Phase.TRAIN
        self.history: list[Transition] = []

    def to_rollout(self) -> Transition:
        self._expect(Phase.TRAIN)
        steps: dict[str, float] = {}
        start = time.perf_counter()
        with self._step(steps, "offload"):
            self._offload()
        # The reshard and the load call no megatron code: outside its CPU mode, which taxes every torch call.
        with self._step(steps, "reshard"), megatron_cpu.suspended():
            params = self.local_params()
            self._element_size = next(iter(params.values())).element_size()
            shards, stats = execute_plan(
                self.plan,
                params,
                dtype=getattr(torch, self.config.rollout_dtype) if self.config.rollout_dtype else None,
                bucket_bytes=self.config.bucket_bytes,
                max_inflight_bytes=self.config.max_inflight_bytes,
            )
        with self._step(steps, "load"), megatron_cpu.suspended():
            self.rollout_engine.wake_up(["weights"])
            self.rollout_engine.load_weights(self.to_rollout_tensors(shards))
            del shards
            self.rollout_engine.wake_up(["kv_cache"])
        return self._record(Phase.ROLLOUT, start, steps, stats)

    def to_train(self) -> Transition:
        self._expect(Phase.ROLLOUT)
        steps: dict[str, float] = {}
        start = time.perf_counter()
        with self._step(steps, "sleep"):
            self.rollout_engine.sleep(self.config.sleep_level)
        with self._step(steps, "restore"):
            self._restore()
        return self._record(Phase.TRAIN, start, steps, None)

    def received_bytes_all_ranks(self) -> int:
        """Bytes every rank together receives per reshard: the plan's total at the rollout dtype."""
        if self.config.rollout_dtype:
            element = getattr(torch, self.config.rollout_dtype).itemsize
        else:  # the training dtype travels: as the last reshard read it (asking local_params again would
            # merge every LoRA-adapted weight once more, in the rollout phase, for one element size)
            element = self._element_size or next(iter(self.local_params().values())).element_size()
        return sum(self.plan.received_bytes().values()) * element // self.plan.bytes_per_element

    def generate(self, prompts: Any, params: Any) -> Any:
        """``rollout_engine.generate`` in the ROLLOUT phase, guarded like the transitions."""
        self._expect(Phase.ROLLOUT)
        with self._guard("rollout"):
            return self.rollout_engine.generate(prompts, params)

    def _guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.ctx.guard(what) if self.ctx is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _step(self, steps: dict[str, float], name: str) -> Iterator[None]:
        with self._guard(name), _timed(steps, name):
            yield

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(
                f"transition requested from {phase.value} but the engine is in {self.phase.value}"
            )

    def _offload(self) -> None:
        if self.config.offload_grad_buffers:
            for chunk in self.train_engine.chunks:
                chunk.offload_grad_buffers()
        if self.config.offload_optimizer and torch.cuda.is_available():
            for optimizer in self.train_engine.optimizers:
                optimizer.offload_to_cpu()

    def _restore(self) -> None:
        if self.config.offload_optimizer and torch.cuda.is_available():
            for optimizer in self.train_engine.optimizers:
                optimizer.restore_from_cpu()
        if self.config.offload_grad_buffers:
            for chunk in self.train_engine.chunks:
                chunk.restore_grad_buffers()

    def _record(
        self, target: Phase, start: float, steps: dict[str, float], stats: ReshardStats | None
    ) -> Transition:
        transition = Transition(
            self.phase, target, time.perf_counter() - start, steps, _memory_in_use(), stats
        )
        self.phase = target
        self.history.append(transition)
        logger.info(
            "hybrid engine %s -> %s in %.3f s (%s), memory in use %.1f MiB",
            transition.source.value,
            target.value,
            transition.seconds,
            ", ".join(f"{k} {v:.3f} s" for k, v in steps.items()),
            transition.memory_bytes / 2**20,
        )
        return transition


@contextlib.contextmanager
def _timed(into: dict[str, float], name: str) -> Iterator[None]:
    """Time one step; on GPU the step's kernels are included and the next step starts on a quiet device."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    into[name] = time.perf_counter() - start
