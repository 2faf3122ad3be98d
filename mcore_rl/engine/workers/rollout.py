"""A rollout pool of its own (``rollout.colocate=false``): rollout engines on ranks apart from the actor's, so
that sampling the next batch overlaps the actor's update (verl's one-step-off placement).

    actor ranks (HybridWorker)                     rollout pool (RolloutWorker, tp = rollout TP, pp = 1)
      update(step k) ──► full_state() ── rank 0's object ref ──► load_full_state(full): cut this rank's
                                          (never through the driver)    rollout-TP shard, load it
                                                                  ──► generate(step k + 1 prompts)
      update(step k + 1) ... runs while the pool samples ...

Ordering is Ray's, not locks': a Ray actor runs its calls one at a time in submission order, so a weight
load submitted after a generate waits for that generate to finish, and a generate submitted after a load
samples the loaded weights. The driver relies on this: it may submit ``generate`` and ``load_weights``
back to back without waiting, and each generate sees exactly the weights submitted before it.

The pool's engine is the same :class:`~mcore_rl.engine.rollout.local.LocalRolloutEngine` the hybrid worker
embeds, loaded from the same full (TP=1) state, so a pool rollout equals the colocated rollout of the same
weights, seed and prompts. It never sleeps: nothing else on its ranks needs the memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from mcore_rl.engine.rollout.layout import rollout_shards_from_full
from mcore_rl.engine.rollout.local import LocalRolloutConfig, LocalRolloutEngine
from mcore_rl.engine.rollout.vllm_engine import VLLMRolloutConfig, VLLMRolloutEngine
from mcore_rl.engine.rollout.vllm_layout import vllm_vocab_divisible_by
from mcore_rl.engine.workers.actor import replica_rollout, replica_turn
from mcore_rl.engine.workers.base import Worker
from mcore_rl.engine.workers.memory import measured, phase_memory
from mcore_rl.types import RankInfo, RolloutBatch, RolloutRequest, TurnRequest


@dataclass(frozen=True)
class RolloutSpec:
    """What every rank of a rollout pool builds."""

    arch: ModelArch
    """The policy architecture (the actor's)."""
    dtype: str = "float32"
    """The engine's weights, activations and KV cache dtype (float32, bfloat16, float16). float32 is what the
    colocated engine runs, whatever the actor's dtype: the two then sample alike."""
    weights_dtype: str | None = None
    """Round the actor's weights to this dtype before loading (``rollout.hybrid.rollout_dtype``, which the
    colocated reshard casts to); None keeps the actor's dtype."""
    pad_token_id: int = 0
    vllm: VLLMRolloutConfig | None = None
    """``rollout.name=vllm``: vLLM as the pool's engine (its own dtype; ``dtype`` is then unused)."""

    def __post_init__(self) -> None:
        for name in ("dtype", "weights_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"RolloutSpec.{name} must be float32, bfloat16 or float16, got {value!r}")


class RolloutWorker(Worker):
    """One rank of a rollout pool: its layout is tp = rollout TP, pp = 1, so the training data-parallel rank
    is the rollout replica and the TP group is the replica's engine group."""

    def build(self, spec: RolloutSpec) -> RankInfo:
        """Collective: the engine (on this rank's device, zero weights until :meth:`load_full_state`)."""
        ctx = self.ctx
        if ctx.pp_size != 1:
            raise ValueError(f"a rollout pool runs pp=1, got pipeline_model_parallel_size={ctx.pp_size}")
        self.spec = spec
        group = ctx.tp_group if ctx.tp_size > 1 else None
        self.engine: RolloutEngine
        if spec.vllm is not None:  # its TP groups are consecutive ranks, as ours at pp = 1
            self.engine = VLLMRolloutEngine(
                spec.arch,
                spec.vllm,
                tensor_parallel_size=ctx.tp_size,
                tp_group=group,
                expected_tp_rank=ctx.tp_rank,
            )
        else:
            config = LocalRolloutConfig(dtype=getattr(torch, spec.dtype))
            self.engine = LocalRolloutEngine(spec.arch, config, tp_group=group, device=ctx.device)
        self.num_loads = 0
        return self.rank_info()

    def rank_info(self) -> RankInfo:
        info = super().rank_info()
        return dataclasses.replace(info, rollout_replica=self.ctx.dp_rank, rollout_tp_rank=self.ctx.tp_rank)

    @measured("sync")
    def load_full_state(self, full: dict[str, torch.Tensor]) -> None:
        """Collective: this rank's rollout-TP shard of the actor's full (TP=1, megatron-named) state
        (``HybridWorker.full_state``), loaded as the hybrid engine's reshard loads its shards."""
        spec, ctx = self.spec, self.ctx
        if spec.weights_dtype is not None:
            cast = getattr(torch, spec.weights_dtype)
            full = {name: t.to(cast) for name, t in full.items()}
        padding = {} if spec.vllm is None else {"vocab_divisible_by": vllm_vocab_divisible_by(ctx.tp_size)}
        shards = rollout_shards_from_full(full, spec.arch, ctx.tp_size, ctx.tp_rank, **padding)
        with ctx.guard("load"):
            self.engine.wake_up(["weights"])
            self.engine.load_weights(shards.items())
            self.engine.wake_up(["kv_cache"])
        self.num_loads += 1

    @measured("generate")
    def generate(self, request: RolloutRequest, params: SamplingParams) -> RolloutBatch | None:
        """Sample this replica's prompts; the replica's TP rank 0 returns the batch (as the hybrid worker)."""
        if self.num_loads == 0:
            raise RuntimeError("generate() before load_full_state(): the rollout pool holds no weights")

        def sample(prompts: list[list[int]], params: SamplingParams) -> Any:
            with self.ctx.guard("rollout"):  # a rank that fails stops its TP peers within seconds
                return self.engine.generate(prompts, params)

        return replica_rollout(sample, request, params, self.rank_info(), self.spec.pad_token_id)

    @measured("generate")
    def generate_turn(self, request: TurnRequest, params: SamplingParams) -> GenerationOutput | None:
        """One turn of this replica's open conversations (as the hybrid worker's ``generate_turn``)."""
        if self.num_loads == 0:
            raise RuntimeError("generate_turn() before load_full_state(): the rollout pool holds no weights")
        with self.ctx.guard("rollout"):
            return replica_turn(self.engine, request, params, self.rank_info())

    def end_conversations(self) -> None:
        """A multi-turn rollout is complete: the engine may free what it kept of its conversations."""
        engine = self.engine
        if isinstance(engine, LocalRolloutEngine | VLLMRolloutEngine):
            engine.end_conversations()

    def take_phase_memory(self) -> dict[str, float]:
        """This rank's per-phase memory peaks since the last call (``engine/workers/memory.py``)."""
        return phase_memory(self).take()

    def shutdown(self) -> None:
        """Leave the world cleanly; vLLM's engine first (its shutdown must find the world it joined)."""
        engine = getattr(self, "engine", None)
        if isinstance(engine, VLLMRolloutEngine):
            engine.close()
        super().shutdown()


__all__ = ["RolloutSpec", "RolloutWorker"]
