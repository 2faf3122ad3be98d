"""The hybrid worker: one rank holding the actor (megatron TrainEngine), its frozen reference policy and the
embedded rollout engine, switched by the 3D-HybridEngine in the same process (HybridFlow's colocated mode).

Phases per rank (``parallel/reshard/hybrid.py``)::

    TRAIN --sync_weights()--> ROLLOUT --generate()*--> (log_probs / update switch back) --> TRAIN

Every method is collective: all ranks of the group call it with the same arguments (their own shard), and
only the owners return data (last pipeline stage with TP rank 0 for training results, rollout TP rank 0
for samples); the others return None. The policy update's methods come from
:class:`~mcore_rl.engine.workers.policy_update.PolicyUpdateHost`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.peft import load_peft_adapter, save_peft_adapter
from mcore_rl.engine.hf.state import load_hf_full_state
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.lora import rollout_parameters
from mcore_rl.engine.lora_spec import LoRASpec
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig, lr_scheduler
from mcore_rl.engine.packing.micro_batches import (
    joined,
    packed,
    pad_positions,
    pad_width,
    positions,
    row_chunks,
)
from mcore_rl.engine.rollout.base import ConversationEngine, GenerationOutput, RolloutEngine, SamplingParams
from mcore_rl.engine.rollout.batch import rollout_batch
from mcore_rl.engine.rollout.local import LocalRolloutEngine
from mcore_rl.engine.rollout.vllm_engine import (
    VLLMRolloutConfig,
    VLLMRolloutEngine,
    build_vllm_hybrid,
    build_vllm_rollout,
)
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.engine.workers.base import Worker
from mcore_rl.engine.workers.critic import CriticHost
from mcore_rl.engine.workers.losses import LogProbMicroBatch, SFTMicroBatch, log_prob_loss, sft_loss
from mcore_rl.engine.workers.memory import measured, phase_memory
from mcore_rl.engine.workers.policy_update import PolicyUpdateHost
from mcore_rl.engine.workers.reward_model import RewardModelHost
from mcore_rl.parallel.config import HybridConfig
from mcore_rl.parallel.reshard.hybrid import Phase
from mcore_rl.types import LogProbBatch, RankInfo, RolloutBatch, RolloutRequest, SFTBatch, TurnRequest

REFERENCE_DIR = "reference"
"""A run checkpoint's copy of the reference policy, where it is not the run's starting model (SFT warm start)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of a hybrid worker group builds."""

    arch: ModelArch
    """The policy architecture."""
    optim: OptimConfig
    """Optimizer and learning-rate schedule of the actor."""
    total_optimizer_steps: int
    """Optimizer steps of the whole run: the end of the learning-rate decay unless ``optim`` says."""
    dtype: str = "float32"
    """Actor parameter dtype (float32 or bfloat16)."""
    rollout_tp: int = 1
    """Rollout tensor-parallel size (any divisor of the world the plan supports)."""
    hybrid: HybridConfig = dataclasses.field(default_factory=HybridConfig)
    """Memory handling of the train <-> rollout switch."""
    with_reference: bool = False
    """Keep a frozen copy of the initial actor as the reference policy (KL loss)."""
    load_dir: str | None = None
    """A megatron model checkpoint (``TrainEngine.save_model`` / HF conversion) to start from."""
    hf_path: str | None = None
    """An HF model folder (safetensors) to start from, read whole on every rank (small models; convert large
    ones with ``mcore-rl convert hf-to-mcore`` and use ``load_dir``). Neither: the seeded random init."""
    pad_token_id: int = 0
    scaled_output_init: bool = True
    """megatron's scaled init of the output projections (random init only; ``model.scaled_output_init``)."""
    keep_logits_bytes: int | None = None
    """Logits the LM head keeps for its backward (``model.keep_logits_gib``; None: the device's default)."""
    remove_padding: bool = False
    """Pack micro-batch rows for the model (``model.use_remove_padding``; ``token_batching.PackedRows``)."""
    share_prompt_prefix: bool = False
    """Pack them with each shared prompt once (``model.share_prompt_prefix``; ``engine/packing/shared_prefix.py``)."""
    vllm: VLLMRolloutConfig | None = None
    """``rollout.name=vllm``: vLLM in this rank's process as the rollout engine, built with these settings;
    None: the embedded engine."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: the load-balancing loss weight (``model.moe_aux_loss_coeff`` resolved)."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: the router z-loss weight (``model.moe_z_loss_coeff``)."""
    router_replay: bool = False
    """Mixture-of-experts models: the trainer routes each token to the experts the rollout chose
    (``actor.router_replay``)."""
    lora: LoRASpec | None = None
    """LoRA adapters on the frozen actor (``model.lora_*``); None trains every weight."""
    lora_adapter_path: str | None = None
    """A PEFT adapter folder loaded into the adapters after the base weights (``model.lora_adapter_path``)."""
    recompute: str = "none"
    """Activation recomputation of the training passes (``model.recompute``)."""


class HybridWorker(PolicyUpdateHost, CriticHost, RewardModelHost, Worker):
    """One rank of the actor/reference/rollout group (and the colocated critic and reward model); see the
    module docstring."""

    def build(self, spec: WorkerSpec) -> RankInfo:
        """Collective: engines, hybrid switch, reference copy and LR schedule; returns the rank's coordinates."""
        ctx = self.ctx
        self.spec = spec
        options = ModelOptions(
            dtype=getattr(torch, spec.dtype),
            scaled_output_init=spec.scaled_output_init,
            keep_logits_bytes=spec.keep_logits_bytes,
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
            moe_z_loss_coeff=spec.moe_z_loss_coeff,
            lora=spec.lora,
            recompute=spec.recompute,
        )
        # vLLM first: on a GPU it checks at construction that its share of the device is still free.
        vllm = build_vllm_rollout(spec.arch, ctx, spec.rollout_tp, spec.vllm) if spec.vllm else None
        self.engine = TrainEngine.build(spec.arch, ctx, options, spec.optim)
        if spec.arch.moe is not None:  # the routing-agreement metric, and router replay when asked
            self.engine.watch_routing().set_replay(spec.router_replay)
        if spec.load_dir is not None:
            self.engine.load_model(spec.load_dir)
        elif spec.hf_path is not None:
            self.engine.load_full_state(load_hf_full_state(spec.hf_path, spec.arch, options.dtype))
        if spec.lora_adapter_path is not None:
            load_peft_adapter(self.engine, spec.lora_adapter_path)
        self.reference = self.engine.frozen_copy() if spec.with_reference else None
        self.reference_is_actor_start = True  # until the SFT warm start moves it (reset_reference)
        self.scheduler = lr_scheduler(self.engine, spec.optim, spec.total_optimizer_steps)
        self.rollout: LocalRolloutEngine | VLLMRolloutEngine
        self.hybrid, self.rollout = (
            build_local_hybrid(self.engine, spec.rollout_tp, spec.hybrid)
            if vllm is None
            else build_vllm_hybrid(self.engine, spec.rollout_tp, spec.hybrid, spec.vllm, prebuilt=vllm)
        )
        return self.rank_info()

    def rank_info(self) -> RankInfo:
        info = super().rank_info()
        if not hasattr(self, "hybrid"):
            return info
        tp_g, replica = self.hybrid.plan.rollout_coords[self.ctx.rank]
        return dataclasses.replace(info, rollout_replica=replica, rollout_tp_rank=tp_g)

    # --- phases ---------------------------------------------------------------------------------------------
    @measured("sync")
    def sync_weights(self) -> dict[str, float]:
        """Reshard the actor's weights into the rollout engine (TRAIN -> ROLLOUT); returns timings."""
        if self.hybrid.phase is Phase.ROLLOUT:
            return {}
        transition = self.hybrid.to_rollout()
        received = transition.reshard.bytes_received if transition.reshard is not None else 0
        return {
            **{f"time/sync_{k}_s": v for k, v in transition.steps_s.items()},  # offload, reshard, load
            # what this rank received (the plan's minimum for it), and what all ranks received (the plan's)
            "sync/received_bytes": float(received),
            "sync/received_bytes_all_ranks": float(self.hybrid.received_bytes_all_ranks()),
            "memory/rollout_phase_bytes": float(transition.memory_bytes),
            # vLLM's own weights and KV cache, resident in every phase where it cannot sleep (CPU)
            **(self.rollout.memory().metrics() if isinstance(self.rollout, VLLMRolloutEngine) else {}),
        }

    def _to_train(self) -> None:
        if self.hybrid.phase is Phase.ROLLOUT:
            self.hybrid.to_train()

    # --- generation -----------------------------------------------------------------------------------------
    @measured("generate")
    def generate(self, request: RolloutRequest, params: SamplingParams) -> RolloutBatch | None:
        """Sample this replica's prompts on the synced weights; the replica's TP rank 0 returns the batch."""
        if self.hybrid.phase is not Phase.ROLLOUT:
            raise RuntimeError("generate() before sync_weights(): the rollout engine holds stale weights")
        # Through the hybrid engine: a rank that fails while sampling stops its TP peers within seconds.
        return replica_rollout(
            self.hybrid.generate, request, params, self.rank_info(), self.spec.pad_token_id
        )

    @measured("generate")
    def generate_turn(self, request: TurnRequest, params: SamplingParams) -> GenerationOutput | None:
        """One turn of this replica's open conversations (multi-turn rollouts, ``agent/rollout.py``); the
        engine keeps what it computed of each context for the next turn. The replica's TP rank 0 returns it."""
        if self.hybrid.phase is not Phase.ROLLOUT:
            raise RuntimeError(
                "generate_turn() before sync_weights(): the rollout engine holds stale weights"
            )
        with self.ctx.guard("rollout"):  # a rank that fails while sampling stops its TP peers within seconds
            return replica_turn(self.rollout, request, params, self.rank_info())

    def end_conversations(self) -> None:
        """A multi-turn rollout is complete: the engine may free what it kept of its conversations."""
        self.rollout.end_conversations()

    # --- training -------------------------------------------------------------------------------------------
    @measured("log_probs")
    def log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int
    ) -> LogProbBatch | None:
        """Actor (and reference) log-probs and actor entropy of ``batch``'s next tokens."""
        self._to_train()
        micro = self._log_prob_micro_batches(batch, micro_batch_size)
        loss = log_prob_loss(self.spec.arch.vocab_size, temperature)
        actor = self.engine.forward_backward(micro, loss, forward_only=True)
        ref = self.reference.forward_backward(micro, loss, forward_only=True) if self.reference else []
        if not self._owns_training_result():
            return None
        width = batch.tokens.shape[1]
        log_probs = joined([m.log_probs for m in actor], width)
        return LogProbBatch(
            actor_log_probs=log_probs,
            entropy=joined([m.entropy for m in actor], width),
            ref_log_probs=joined([m.log_probs for m in ref], width) if ref else torch.zeros_like(log_probs),
        )

    @measured("log_probs")  # the same forward-only phase, run for the reference alone
    def ref_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int
    ) -> torch.Tensor | None:
        """[N, S] the reference policy's log-probs of ``batch``'s next tokens: what the KL loss needs when
        the on-policy shortcut skips the actor's pass."""
        if self.reference is None:
            raise RuntimeError("ref_log_probs(): no reference policy was built (algorithm.use_kl_loss=false)")
        self._to_train()
        micro = self._log_prob_micro_batches(batch, micro_batch_size)
        loss = log_prob_loss(self.spec.arch.vocab_size, temperature)
        ref = self.reference.forward_backward(micro, loss, forward_only=True)
        return (
            joined([m.log_probs for m in ref], batch.tokens.shape[1])
            if self._owns_training_result()
            else None
        )

    def _log_prob_micro_batches(self, batch: RolloutBatch, micro_batch_size: int) -> list[MicroBatch]:
        multiple = self.ctx.sequence_multiple
        tokens = pad_width(batch.tokens, multiple, self.spec.pad_token_id)
        masks = pad_width(batch.response_mask, multiple, 0.0).split(micro_batch_size)
        choices = pad_positions(batch.expert_choices, multiple)
        routing = [None] * len(masks) if choices is None else list(choices.split(micro_batch_size))
        return [  # only the response positions are projected (0 elsewhere)
            self._packed(LogProbMicroBatch(t, positions(t), expert_choices=c, mask=m), m)
            for t, m, c in zip(row_chunks(tokens, micro_batch_size), masks, routing, strict=True)
        ]

    def set_optim(self, optim: OptimConfig, total_optimizer_steps: int) -> None:
        """Continue with the same optimizer state under new hyper-parameters and a fresh LR schedule
        (SFT warm start -> RL)."""
        for optimizer in self.engine.optimizers:
            optimizer.config.clip_grad = optim.clip_grad
            for group in optimizer.param_groups:
                group["betas"], group["eps"] = (optim.adam_beta1, optim.adam_beta2), optim.adam_eps
        self.scheduler = lr_scheduler(self.engine, optim, total_optimizer_steps)

    def sft_update(self, batch: SFTBatch, micro_batch_size: int) -> dict[str, float] | None:
        """One supervised optimizer step on this rank's shard; the DP-global loss and grad norm on the owner."""
        self._to_train()
        ctx, multiple = self.ctx, self.ctx.sequence_multiple
        tokens = pad_width(batch.tokens, multiple, self.spec.pad_token_id)
        mask = pad_width(batch.loss_mask, multiple, 0.0)
        count = mask.sum().reshape(1)
        ctx.all_reduce(count, ctx.dp_group)
        micro: list[MicroBatch] = [
            self._packed(SFTMicroBatch(t, positions(t), loss_mask=m), m)
            for t, m in zip(row_chunks(tokens, micro_batch_size), mask.split(micro_batch_size), strict=True)
        ]
        self.engine.zero_grad()
        self.engine.seed_dropout(self.scheduler.num_steps)
        out = self.engine.forward_backward(micro, sft_loss(self.spec.arch.vocab_size, count.clamp(min=1)))
        loss = torch.tensor([sum(float(m.loss) for m in out)])
        self.engine.finite_or_skip(loss, "stop", "SFT loss")  # names the rank; the weights stay as they were
        self.scheduler.step(1)
        result = self.engine.step()
        if out:
            ctx.all_reduce(loss, ctx.dp_group)
        if not self._owns_training_result():
            return None
        return {"loss": float(loss), "grad_norm": result.grad_norm}

    def _packed(self, micro: MicroBatch, mask: torch.Tensor) -> MicroBatch:
        return packed(
            micro,
            mask,
            self.ctx.sequence_multiple,
            self.spec.pad_token_id,
            remove_padding=self.spec.remove_padding,
            share_prompt_prefix=self.spec.share_prompt_prefix,
        )

    def take_phase_memory(self) -> dict[str, float]:
        """This rank's per-phase memory peaks since the last call (``trainer/memory.py``)."""
        return phase_memory(self).take()

    def save_model(self, directory: str, assets: tuple[str | None, str | None] = (None, None)) -> None:
        """Collective: the actor's weights alone as a model checkpoint (any layout loads it), with the side
        files of ``assets`` (its tokenizer folder, its model folder)."""
        self._to_train()
        self.engine.save_model(directory, assets)

    def save_lora_adapter(self, directory: str, base_model: str | None) -> None:
        """Collective: the actor's LoRA adapters as a PEFT folder (``engine/hf/peft.py``)."""
        save_peft_adapter(self.engine, directory, base_model)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the actor's full (TP=1) weights on rank 0 (to start a critic on another pool)."""
        self._to_train()
        models, arch = self.engine.models, self.spec.arch
        merged = rollout_parameters(models, arch, self.ctx)  # with LoRA, the adapters merged in
        full = gather_full_state(models, arch, self.ctx, merged)
        return full if self.ctx.rank == 0 else None

    def shutdown(self) -> None:
        """Leave the world cleanly; vLLM's engine first (its shutdown must find the world it joined)."""
        rollout = getattr(self, "rollout", None)
        if isinstance(rollout, VLLMRolloutEngine):
            rollout.close()
        super().shutdown()

    def _owns_training_result(self) -> bool:
        return self.ctx.is_last_stage and self.ctx.tp_rank == 0 and self.ctx.cp_rank == 0

    # --- checkpoints ----------------------------------------------------------------------------------------
    def reset_reference(self) -> None:
        """Collective: the reference policy becomes a copy of the actor as it is now (the SFT warm start's
        result, where RL starts: what a KL term must measure against), saved with each run checkpoint from
        then on. LoRA's reference (the base, adapters off) cannot follow: ``config/validate.py`` refuses it."""
        if self.reference is None:
            return
        if self.engine.options.lora is not None:
            raise RuntimeError("reset_reference(): a LoRA run's reference is the frozen base")
        self.reference = self.engine.frozen_copy()
        self.reference_is_actor_start = False

    def save_checkpoint(self, directory: str, step: int, extra: dict[str, Any]) -> None:
        """Collective: actor weights + optimizer + LR schedule + ``extra`` (driver state), atomically; the
        reference's weights beside them (``reference/``) when they are no longer the run's starting model."""
        from mcore_rl.engine.trainer_checkpoint import save_training_checkpoint

        self._to_train()
        state = {**extra, "lr_scheduler": self.scheduler.state_dict()}
        save_training_checkpoint(self.engine, directory, step, state)
        if self.reference is not None and not self.reference_is_actor_start:
            self.reference.save_model(os.path.join(directory, REFERENCE_DIR))

    def load_checkpoint(self, directory: str) -> tuple[int, dict[str, Any]]:
        """Collective: restore what :meth:`save_checkpoint` wrote; returns (step, extra)."""
        from mcore_rl.engine.trainer_checkpoint import load_training_checkpoint

        self._to_train()
        step, extra = load_training_checkpoint(self.engine, directory)
        self.scheduler.load_state_dict(extra.pop("lr_scheduler"))
        reference = os.path.join(directory, REFERENCE_DIR)
        if self.reference is not None and os.path.isdir(reference):  # the SFT warm start's, not model.path's
            self.reference.load_model(reference)
            self.reference_is_actor_start = False
        return step, extra


def replica_turn(
    engine: LocalRolloutEngine | VLLMRolloutEngine | RolloutEngine,
    request: TurnRequest,
    params: SamplingParams,
    info: RankInfo,
) -> GenerationOutput | None:
    """One rollout replica's share of a multi-turn rollout's turn (the hybrid worker's and a rollout pool's):
    the replica's own seed stream, as :func:`replica_rollout`; nothing to sample when none of its
    conversations is open (every rank of the replica gets the same request)."""
    if not request.conversations:
        return None
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + 1_000_003 * info.rollout_replica)
    assert isinstance(engine, ConversationEngine), f"{type(engine).__name__} cannot continue conversations"
    out = engine.continue_conversations(
        request.conversations, request.contexts, params, request.max_new_tokens
    )
    return out if info.rollout_tp_rank == 0 else None


def replica_rollout(
    generate: Callable[[list[list[int]], SamplingParams], GenerationOutput],
    request: RolloutRequest,
    params: SamplingParams,
    info: RankInfo,
    pad_token_id: int,
) -> RolloutBatch | None:
    """One rollout replica's share of a ``generate`` call (the hybrid worker's and a rollout pool's): each
    replica samples its own seed stream; the replica's TP rank 0 returns the batch, its peers None."""
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + 1_000_003 * info.rollout_replica)
    out = generate(request.prompt_ids, params)
    if info.rollout_tp_rank != 0:
        return None
    return rollout_batch(request.prompt_ids, request.prompt_index, out, pad_token_id)
