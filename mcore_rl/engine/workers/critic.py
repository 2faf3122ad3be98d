"""The critic of PPO: a value-head megatron model with its own optimizer, LR schedule and checkpoint.

    rollout tokens ──► Critic.values ──► [N, S] V(s_t) ──► GAE (driver, pure) ──► returns
                                                                                      │
                       Critic.update (clipped value loss, its own Adam) ◄─────────────┘

``values[:, t]`` is the value of the state that ends at token ``t``: the position whose logits pick token
``t + 1``, i.e. the same column as that token's mask, log-prob and advantage (``mcore_rl/types.py``).

:class:`Critic` is what one rank holds; :class:`CriticHost` gives a worker the collective methods the driver
calls (a :class:`~mcore_rl.engine.workers.actor.HybridWorker` holds the critic beside the actor: the colocated
placement), and :class:`CriticGroup` is the driver's handle, splitting batches over data-parallel ranks
like :class:`~mcore_rl.trainer.groups.actor.ActorGroup`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.state import load_hf_full_state
from mcore_rl.engine.lora import rollout_parameters
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig, lr_scheduler
from mcore_rl.engine.packing.micro_batches import mini_batch_slices
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.engine.workers.base import Worker
from mcore_rl.engine.workers.losses import ValueMicroBatch, critic_loss, forward_values_loss
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import CriticStats, RankInfo, RolloutBatch, ValueBatch

CRITIC_DIR = "critic"
"""The critic's training checkpoint, inside the run checkpoint folder."""


CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"


@dataclass(frozen=True)
class CriticSpec:
    """What every rank builds for the critic."""

    arch: ModelArch
    """The actor's architecture; the critic swaps the vocab projection for a scalar head."""
    optim: OptimConfig
    """The critic's optimizer and LR schedule."""
    total_optimizer_steps: int
    """Critic optimizer steps of the run (the end of the LR decay unless ``optim`` says)."""
    cliprange_value: float = 0.5
    """Value clipping of the loss."""
    dtype: str = "float32"
    hf_path: str | None = None
    """An HF folder whose transformer body starts the critic; None: the actor's weights (``init_from``)."""
    pad_token_id: int = 0
    remove_padding: bool = False
    """Pack micro-batch rows for the model (``model.use_remove_padding``): values are read on the response
    only, so rows are cut after their last response position."""
    on_nonfinite: str = "stop"
    """``trainer.on_nonfinite_loss``: a NaN/inf critic loss or gradient stops the run or skips the update."""
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts critics: the router losses' weights, the actor's (``model.moe_*_coeff``)."""
    recompute: str = "none"
    """Activation recomputation (``model.recompute``), as the actor's."""


class Critic:
    """The critic on one rank (see the module docstring); every method is collective over the layout."""

    def __init__(self, ctx: ParallelContext, spec: CriticSpec, init_from: TrainEngine | None = None) -> None:
        self.ctx, self.spec = ctx, spec
        options = ModelOptions(
            dtype=getattr(torch, spec.dtype),
            value_head=True,
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
            moe_z_loss_coeff=spec.moe_z_loss_coeff,
            recompute=spec.recompute,
        )
        self.engine = TrainEngine.build(spec.arch, ctx, options, spec.optim)
        if spec.hf_path is not None:
            self.load_body(load_hf_full_state(spec.hf_path, spec.arch, options.dtype))
        elif init_from is not None:
            self.init_from(init_from)
        self.scheduler = lr_scheduler(self.engine, spec.optim, spec.total_optimizer_steps)

    def init_from(self, actor: TrainEngine) -> None:
        """The actor's current transformer weights into the critic body (same layout); the head is kept."""
        merged = rollout_parameters(actor.models, actor.arch, self.ctx)  # a LoRA actor's adapters merged in
        self.load_body(gather_full_state(actor.models, actor.arch, self.ctx, merged))

    def load_body(self, full: dict[str, torch.Tensor]) -> None:
        """A full (TP=1) policy state into the body; the value head keeps its own weights."""
        own = gather_full_state(self.engine.models, self.spec.arch, self.ctx)
        self.engine.load_full_state({**full, "output_layer.weight": own["output_layer.weight"]})

    def values(
        self, tokens: torch.Tensor, micro_batch_size: int, response_mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """[N, S] values of this rank's rows; the owner (last stage, TP rank 0) returns them. With packing
        (``spec.remove_padding`` and a ``response_mask``) they are 0 after each row's response."""
        from mcore_rl.engine.packing.micro_batches import pad_width, plain_micro_batch, row_chunks

        padded = pad_width(tokens, self.ctx.sequence_multiple, self.spec.pad_token_id)
        micro = [plain_micro_batch(t) for t in row_chunks(padded, micro_batch_size, CRITIC_MICRO)]
        if response_mask is not None:
            masks = pad_width(response_mask, self.ctx.sequence_multiple, 0.0).split(micro_batch_size)
            micro = [self._packed(m, mask) for m, mask in zip(micro, masks, strict=True)]
        out = self.engine.forward_backward(micro, forward_values_loss(), forward_only=True)
        if not self._owns_result():
            return None
        return torch.cat([m.values for m in out])[:, : tokens.shape[1]]

    def update(
        self, batch: ValueBatch, num_mini_batches: int, ppo_epochs: int, micro_batch_size: int
    ) -> CriticStats | None:
        """Epochs over mini-batches (one critic optimizer step each) of this rank's shard."""
        batch = self._pad(batch)
        sums, steps, skipped = torch.zeros(4), 0, 0  # vf_loss, vf_clip_frac, vpred_mean, grad_norm
        for _ in range(ppo_epochs):
            for rows in mini_batch_slices(batch.tokens.shape[0], num_mini_batches):
                applied = self._optimizer_step(_slice(batch, rows), micro_batch_size)
                if applied is None:  # skipped for a NaN/inf loss or gradient
                    skipped += 1
                else:
                    sums, steps = sums + applied, steps + 1
        if not self._owns_result():
            return None
        vf_loss, clip_frac, vpred, grad_norm = (sums / max(steps, 1)).tolist()
        lr = float(self.engine.optimizers[0].param_groups[0]["lr"])
        return CriticStats(vf_loss, clip_frac, vpred, grad_norm, lr, num_skipped=skipped)

    def _optimizer_step(self, mini: ValueBatch, micro_batch_size: int) -> torch.Tensor | None:
        from mcore_rl.engine.packing.micro_batches import positions, row_chunks

        count = mini.response_mask.sum().reshape(1)
        self.ctx.all_reduce(count, self.ctx.dp_group)  # the mini-batch's global response tokens
        row_chunks(mini.tokens, micro_batch_size, CRITIC_MICRO)  # validates the split
        micro: list[MicroBatch] = [
            self._packed(
                ValueMicroBatch(part.tokens, positions(part.tokens), values=part), part.response_mask
            )
            for part in _chunks(mini, micro_batch_size)
        ]
        self.engine.zero_grad()
        out = self.engine.forward_backward(micro, critic_loss(self.spec.cliprange_value, count.clamp(min=1)))
        local = torch.stack([m.summable() for m in out]).sum(0) if out else torch.zeros(3)
        if not self.engine.finite_or_skip(local, self.spec.on_nonfinite, "critic loss"):
            return None
        self.scheduler.step(1)
        result = self.engine.step()
        if out:
            self.ctx.all_reduce(local, self.ctx.dp_group)
        return torch.cat([local, torch.tensor([result.grad_norm])])

    def _packed(self, micro: MicroBatch, mask: torch.Tensor) -> MicroBatch:
        from mcore_rl.engine.packing.micro_batches import packed

        return packed(
            micro,
            mask,
            self.ctx.sequence_multiple,
            self.spec.pad_token_id,
            remove_padding=self.spec.remove_padding,
        )

    # --- checkpoints ----------------------------------------------------------------------------------------
    def save(self, run_checkpoint: str, step: int) -> None:
        from mcore_rl.engine.trainer_checkpoint import save_training_checkpoint

        state = {"lr_scheduler": self.scheduler.state_dict()}
        save_training_checkpoint(self.engine, os.path.join(run_checkpoint, CRITIC_DIR), step, state)

    def load(self, run_checkpoint: str) -> None:
        from mcore_rl.engine.trainer_checkpoint import load_training_checkpoint

        path = os.path.join(run_checkpoint, CRITIC_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{run_checkpoint}: no {CRITIC_DIR}/ (saved by a run without a critic)")
        _, extra = load_training_checkpoint(self.engine, path)
        self.scheduler.load_state_dict(extra["lr_scheduler"])

    def _pad(self, batch: ValueBatch) -> ValueBatch:
        from mcore_rl.engine.packing.micro_batches import pad_width

        if self.ctx.sequence_multiple == 1:
            return batch
        fields = {f.name: pad_width(getattr(batch, f.name), self.ctx.sequence_multiple, 0.0) for f in _FIELDS}
        fields["tokens"] = pad_width(batch.tokens, self.ctx.sequence_multiple, self.spec.pad_token_id)
        return ValueBatch(**fields)

    def _owns_result(self) -> bool:
        return self.ctx.is_last_stage and self.ctx.tp_rank == 0 and self.ctx.cp_rank == 0


_FIELDS = dataclasses.fields(ValueBatch)


def _slice(batch: ValueBatch, rows: slice) -> ValueBatch:
    return ValueBatch(*(getattr(batch, f.name)[rows] for f in _FIELDS))


def _chunks(batch: ValueBatch, size: int) -> list[ValueBatch]:
    num = batch.tokens.shape[0] // size
    return [_slice(batch, slice(i * size, (i + 1) * size)) for i in range(num)]


class CriticHost:
    """The critic's collective methods on a worker that holds ``self.critic`` (and ``self.ctx``)."""

    critic: Critic | None = None
    ctx: ParallelContext

    def build_critic(self, spec: CriticSpec) -> None:
        """Collective: the critic, started from ``spec.hf_path`` or this worker's actor (when it has one)."""
        self.critic = Critic(self.ctx, spec, init_from=getattr(self, "engine", None))

    def critic_load_body(self, full: dict[str, torch.Tensor]) -> None:
        """Collective: a full (TP=1) policy state into the critic body (the actor's, from another pool)."""
        self._critic().load_body(full)

    def critic_save(self, run_checkpoint: str, step: int) -> None:
        self._critic().save(run_checkpoint, step)

    def critic_load(self, run_checkpoint: str) -> None:
        self._critic().load(run_checkpoint)

    def critic_init_from_actor(self) -> None:
        """Collective: restart the critic body from the actor's current weights (after the SFT warm start)."""
        self._critic().init_from(self.engine)  # type: ignore[attr-defined]

    def critic_values(self, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor | None:
        return self._critic().values(batch.tokens, micro_batch_size, batch.response_mask)

    def critic_update(
        self, batch: ValueBatch, num_mini_batches: int, ppo_epochs: int, micro_batch_size: int
    ) -> CriticStats | None:
        return self._critic().update(batch, num_mini_batches, ppo_epochs, micro_batch_size)

    def _critic(self) -> Critic:
        if self.critic is None:
            raise RuntimeError(
                "the critic is not built: call build_critic first (algorithm.adv_estimator=gae)"
            )
        return self.critic


class CriticWorker(CriticHost, Worker):
    """A rank of a critic on its own resource pool (``critic.colocate=false``), in its own layout."""

    def build(self, spec: CriticSpec) -> RankInfo:
        self.build_critic(spec)
        return self.rank_info()


__all__ = [
    "CRITIC_DIR",
    "Critic",
    "CriticHost",
    "CriticSpec",
    "CriticWorker",
]
