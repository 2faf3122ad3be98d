"""One rank of a DPO run: the policy (megatron TrainEngine), its frozen reference, and the collective steps.

Every method is collective: all ranks call it with their own data-parallel shard of the pairs. Results that
the last pipeline stage computes are reduced over data-parallel ranks and then shared along the pipeline, so
every rank returns the same global values (rank 0 logs them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.data.preference import PreferenceBatch
from mcore_rl.dpo.loss import (
    METRICS,
    DPOLossMetrics,
    DPOLossSettings,
    PairMicroBatch,
    dpo_pair_loss,
    sequence_log_prob_loss,
)
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.peft import load_peft_adapter
from mcore_rl.engine.lora_spec import LoRASpec
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig, lr_scheduler
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.context import ParallelContext


@dataclass(frozen=True)
class PolicySpec:
    """What every rank builds."""

    arch: ModelArch
    optim: OptimConfig
    total_steps: int
    """Optimizer steps of the run (the end of the learning-rate decay unless ``optim`` says)."""
    loss: DPOLossSettings
    micro_batch_pairs: int
    """Pairs per micro-batch on one data-parallel rank."""
    with_reference: bool
    """Keep a frozen copy of the initial policy (False: precomputed or reference-free)."""
    dtype: str = "float32"
    scaled_output_init: bool = True
    """megatron's scaled init of the output projections (random init only; ``model.scaled_output_init``)."""
    keep_logits_bytes: int | None = None
    """Logits the LM head keeps for its backward (``model.keep_logits_gib``; None: the device's default)."""
    lora: LoRASpec | None = None
    """LoRA adapters on the frozen policy (``model.lora_*``); the reference is then the base, adapters off."""
    lora_adapter_path: str | None = None
    """A PEFT adapter folder loaded into the adapters after the base weights (``model.lora_adapter_path``).
    The reference would then be the base without it, not the policy DPO starts from: it needs
    ``with_reference=False`` (precomputed reference log-probs, or reference-free)."""
    pad_token_id: int = 0
    recompute: str = "none"
    """Activation recomputation (``model.recompute``)."""
    on_nonfinite: str = "stop"
    """stop (raise, naming the step) or skip (drop the update)."""

    def __post_init__(self) -> None:
        if self.lora_adapter_path is not None and self.with_reference:  # config/validate.py names the keys
            raise ValueError(
                f"model.lora_adapter_path={self.lora_adapter_path}: the reference model would be the base "
                "without the adapter; needs dpo.precompute_ref_log_probs=true or dpo.reference_free=true"
            )


class DPOPolicy:
    """Policy + reference engines of this rank; build with :meth:`build`."""

    def __init__(self, ctx: ParallelContext, spec: PolicySpec, engine: TrainEngine, reference: Any) -> None:
        self.ctx = ctx
        self.spec = spec
        self.engine = engine
        self.reference: TrainEngine | None = reference
        self.scheduler = lr_scheduler(engine, spec.optim, spec.total_steps)

    @classmethod
    def build(
        cls, ctx: ParallelContext, spec: PolicySpec, full_state: dict[str, torch.Tensor] | None = None
    ) -> DPOPolicy:
        """Collective: the policy (``full_state`` loaded when given, else the seeded random initialisation; then
        the PEFT adapter of ``spec.lora_adapter_path``) and the reference, a frozen copy of it."""
        options = ModelOptions(
            dtype=getattr(torch, spec.dtype),
            scaled_output_init=spec.scaled_output_init,
            lora=spec.lora,
            keep_logits_bytes=spec.keep_logits_bytes,
            recompute=spec.recompute,
        )
        engine = TrainEngine.build(spec.arch, ctx, options, spec.optim)
        if full_state is not None:
            engine.load_full_state(full_state)
        if spec.lora_adapter_path is not None:
            load_peft_adapter(engine, spec.lora_adapter_path)
        return cls(ctx, spec, engine, engine.frozen_copy() if spec.with_reference else None)

    # --- batches --------------------------------------------------------------------------------------------
    @property
    def width_multiple(self) -> int:
        return self.ctx.sequence_multiple

    def micro_batches(
        self, batch: PreferenceBatch, weights: torch.Tensor, ref: torch.Tensor | None
    ) -> list[PairMicroBatch]:
        """``batch`` ([2B, S]) in micro-batches of whole pairs; ``ref`` [B, 2] (chosen, rejected) or None."""
        size, pairs = self.spec.micro_batch_pairs, batch.num_pairs
        if pairs % size:
            raise ValueError(
                f"dpo.micro_batch_size_per_gpu={size} does not divide the {pairs} pairs of this rank"
            )
        out = []
        for start in range(0, pairs, size):
            part = batch.pairs(start, start + size)
            positions = torch.arange(part.tokens.shape[1]).expand_as(part.tokens)
            part_ref = (
                None
                if ref is None
                else torch.cat([ref[start : start + size, 0], ref[start : start + size, 1]])
            )
            out.append(
                PairMicroBatch(
                    part.tokens,
                    positions,
                    loss_mask=part.loss_mask,
                    ref_log_probs=part_ref,
                    pair_weights=weights[start : start + size],
                )
            )
        return out

    def fill_reference(self, micro: list[PairMicroBatch]) -> None:
        """Fill ``ref_log_probs`` from the reference model (or zeros: reference-free / precomputed elsewhere)."""
        if all(mb.ref_log_probs is not None for mb in micro):
            return
        if self.reference is None:
            if not self.spec.loss.dpo.reference_free:
                raise RuntimeError("no reference model and no precomputed reference log-probs")
            for mb in micro:
                mb.ref_log_probs = torch.zeros(mb.tokens.shape[0])
            return
        loss = sequence_log_prob_loss(self.ctx, self.spec.arch.vocab_size)
        ref = self.reference.forward_backward(list[MicroBatch](micro), loss, forward_only=True)
        for i, mb in enumerate(micro):
            mb.ref_log_probs = ref[i].logps if ref else torch.zeros(mb.tokens.shape[0])

    # --- steps ----------------------------------------------------------------------------------------------
    def train_step(self, micro: list[PairMicroBatch], step: int) -> dict[str, float] | None:
        """One optimizer step on this rank's micro-batches; global metrics (None: skipped as non-finite)."""
        self.fill_reference(micro)
        global_pairs = self._global_pairs(micro)
        self.engine.zero_grad()
        self.engine.seed_dropout(self.scheduler.num_steps)
        out = self.engine.forward_backward(
            list[MicroBatch](micro), dpo_pair_loss(self.spec.loss, self.ctx, global_pairs)
        )
        local = _stack(out)
        if not self.engine.finite_or_skip(local, self.spec.on_nonfinite, f"DPO loss at step {step}"):
            return None
        self.scheduler.step(1)
        result = self.engine.step()
        metrics = self._share(local, bool(out))
        metrics.update(grad_norm=result.grad_norm, lr=float(self.engine.optimizers[0].param_groups[0]["lr"]))
        return metrics

    def evaluate(self, micro: list[PairMicroBatch]) -> dict[str, float]:
        """Forward only: the loss and TRL metrics of held-out pairs, prefixed ``eval_``."""
        self.fill_reference(micro)
        global_pairs = self._global_pairs(micro)
        out = self.engine.forward_backward(
            list[MicroBatch](micro), dpo_pair_loss(self.spec.loss, self.ctx, global_pairs), forward_only=True
        )
        return {f"eval_{k}": v for k, v in self._share(_stack(out), bool(out)).items()}

    def sequence_log_probs(self, micro: list[PairMicroBatch]) -> torch.Tensor:
        """[pairs, 2] summed (chosen, rejected) log-probs of this rank's pairs under the *policy*, on every
        rank of the pipeline (used to precompute reference log-probs before training)."""
        loss = sequence_log_prob_loss(self.ctx, self.spec.arch.vocab_size)
        out = self.engine.forward_backward(list[MicroBatch](micro), loss, forward_only=True)
        pairs = sum(mb.num_pairs for mb in micro)
        local = torch.zeros(pairs, 2)
        if out:
            rows = [m.logps.view(2, -1).t() for m in out]  # [2m] -> [m, 2]
            local = torch.cat(rows).float()
        if self.ctx.pp_size > 1:  # only the last stage computed them; zeros elsewhere make the sum a copy
            dist.all_reduce(local, group=self.ctx.pp_group)
        return local

    def _global_pairs(self, micro: Sequence[PairMicroBatch]) -> torch.Tensor:
        count = (
            torch.stack([mb.pair_weights.sum() for mb in micro if mb.pair_weights is not None])
            .sum()
            .reshape(1)
        )
        dist.all_reduce(count, group=self.ctx.dp_group)
        return count.clamp(min=1)[0]  # a scalar: the metrics divided by it stay scalars

    def _share(self, local: torch.Tensor, holds_result: bool) -> dict[str, float]:
        """Shares summed over micro-batches -> over DP ranks -> copied along the pipeline."""
        if holds_result:
            dist.all_reduce(local, group=self.ctx.dp_group)
        else:
            local.zero_()
        if self.ctx.pp_size > 1:
            dist.all_reduce(local, group=self.ctx.pp_group)
        return dict(zip(METRICS, local.tolist(), strict=True))

    # --- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        directory: str,
        step: int,
        extra: dict[str, Any],
        side_files: Callable[[str], None] | None = None,
    ) -> None:
        """Collective: policy weights + optimizer + LR schedule + ``extra`` (driver state), atomically, with
        ``side_files`` written into the folder before it is published."""
        from mcore_rl.engine.trainer_checkpoint import save_training_checkpoint

        save_training_checkpoint(
            self.engine, directory, step, {**extra, "lr_scheduler": self.scheduler.state_dict()}, side_files
        )

    def load_checkpoint(self, directory: str) -> tuple[int, dict[str, Any]]:
        """Collective: what :meth:`save_checkpoint` wrote; returns (step, extra). The reference stays the
        initial policy (rebuilt from the same start), as it was when the checkpoint was written."""
        from mcore_rl.engine.trainer_checkpoint import load_training_checkpoint

        step, extra = load_training_checkpoint(self.engine, directory)
        self.scheduler.load_state_dict(extra.pop("lr_scheduler"))
        return step, extra


def _stack(out: list[DPOLossMetrics]) -> torch.Tensor:
    if not out:
        return torch.zeros(len(METRICS))
    return torch.stack([m.summable() for m in out]).sum(0)


def shard_indices(
    indices: Sequence[int], ctx: ParallelContext, multiple: int
) -> tuple[list[int], torch.Tensor]:
    """This data-parallel rank's contiguous share of ``indices``, padded (by repeating the last index, weight
    0) to a multiple of ``multiple`` per rank; returns (indices, [n] pair weights)."""
    dp = ctx.dp_size
    per_rank = -(-len(indices) // dp)
    per_rank += -per_rank % multiple
    padded = list(indices) + [indices[-1]] * (per_rank * dp - len(indices))
    weights = torch.tensor([1.0] * len(indices) + [0.0] * (len(padded) - len(indices)))
    lo = ctx.dp_rank * per_rank
    return padded[lo : lo + per_rank], weights[lo : lo + per_rank]
