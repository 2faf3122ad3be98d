"""The actor's policy update on one rank: PPO epochs over mini-batches, one optimizer step each, or the
on-policy step whose old log-probs are its own forward's; the stats reduced over data-parallel ranks.

:class:`PolicyUpdateHost` gives the hybrid worker (``actor.py``) these collective methods, as
:class:`~mcore_rl.engine.workers.critic.CriticHost` gives it the critic's; the worker holds the engine, the
LR schedule and the micro-batch packing they use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.engine.moe import RouterLosses
from mcore_rl.engine.packing.micro_batches import (
    at_rows,
    micro_parts,
    mini_batch_slices,
    pad_record,
    positions,
    slice_rows,
)
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.workers.losses import POLICY_METRICS, PolicyLossSettings, PolicyMicroBatch, policy_loss
from mcore_rl.engine.workers.memory import measured
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import OnPolicyUpdate, TrainBatch, UpdateStats

if TYPE_CHECKING:
    from mcore_rl.engine.workers.actor import WorkerSpec


class PolicyUpdateHost:
    """The actor's update methods on a worker that holds ``self.engine``, ``self.scheduler`` and ``self.spec``
    and packs micro-batches, switches to training and owns results as the hybrid worker does."""

    ctx: ParallelContext
    engine: TrainEngine
    scheduler: Any
    """megatron's ``OptimizerParamScheduler`` (``optim.lr_scheduler``), stepped once per optimizer step."""
    spec: WorkerSpec
    # the hybrid worker's own methods, which this mixin calls (declared here for the type checker)
    _to_train: Callable[[], None]
    _packed: Callable[[MicroBatch, torch.Tensor], MicroBatch]
    _owns_training_result: Callable[[], bool]

    @measured("update")
    def update(
        self,
        batch: TrainBatch,
        settings: PolicyLossSettings,
        num_mini_batches: int,
        ppo_epochs: int,
        micro_batch_size: int,
        on_nonfinite: str = "stop",
        token_budget: int | None = None,
    ) -> UpdateStats | None:
        """PPO epochs over mini-batches (one optimizer step each) of this rank's shard; the step's stats,
        reduced over data-parallel ranks, on the owner."""
        plan = (num_mini_batches, ppo_epochs, micro_batch_size, on_nonfinite, token_budget)
        return self._update(batch, settings, *plan)[0]

    @measured("update")
    def update_on_policy(
        self,
        batch: TrainBatch,
        settings: PolicyLossSettings,
        micro_batch_size: int,
        on_nonfinite: str = "stop",
        token_budget: int | None = None,
    ) -> OnPolicyUpdate | None:
        """One optimizer step on this rank's shard whose old log-probs are its own forward's, detached
        (``batch.old_log_probs`` is not read); on the owner the stats and that forward's log-probs of the
        shard's rows, in their order."""
        on_policy = dataclasses.replace(settings, on_policy=True)
        stats, log_probs = self._update(batch, on_policy, 1, 1, micro_batch_size, on_nonfinite, token_budget)
        if stats is None or log_probs is None:
            return None
        return OnPolicyUpdate(stats, log_probs)

    def _update(
        self,
        batch: TrainBatch,
        settings: PolicyLossSettings,
        num_mini_batches: int,
        ppo_epochs: int,
        micro_batch_size: int,
        on_nonfinite: str,
        token_budget: int | None,
    ) -> tuple[UpdateStats | None, torch.Tensor | None]:
        """(stats, [N, S] forward log-probs when ``settings.on_policy``) on the owner, (None, None) elsewhere."""
        if settings.on_policy and num_mini_batches * ppo_epochs != 1:
            raise ValueError(
                "on-policy update (old log-probs from its own forward): needs one optimizer step, got "
                f"{num_mini_batches} mini-batches x {ppo_epochs} epochs"
            )
        self._to_train()
        width, pad = batch.tokens.shape[1], self.ctx.sequence_multiple
        batch = pad_record(batch, pad, self.spec.pad_token_id)
        sums = torch.zeros(len(POLICY_METRICS) + 1)  # POLICY_METRICS, then grad_norm
        steps = skipped = 0
        log_probs = None
        router: list[RouterLosses] = []
        agreement: float | None = None
        for epoch in range(ppo_epochs):
            for index, rows in enumerate(mini_batch_slices(batch.tokens.shape[0], num_mini_batches)):
                mini = slice_rows(batch, rows)
                first = epoch == 0 and index == 0  # the weights that sampled the rollout (lag 0)
                with self._routing_counted(first):
                    metrics, log_probs = self._optimizer_step(
                        mini, settings, micro_batch_size, on_nonfinite, token_budget
                    )
                if first and self.engine.routing is not None:
                    agreement = self.engine.routing.take_agreement()
                if metrics is None:
                    skipped += 1
                    continue
                sums += metrics
                steps += 1
                router.append(self.engine.router_losses)
        if not self._owns_training_result():
            return None, None
        pg, kl, entropy, clip, clip_lower, approx_kl, grad_norm = (sums / max(steps, 1)).tolist()
        stats = UpdateStats(
            pg_loss=pg,
            kl_loss=kl,
            entropy=entropy,
            clip_frac=clip,
            clip_frac_lower=clip_lower,
            approx_kl=approx_kl,
            grad_norm=grad_norm,
            lr=float(self.engine.optimizers[0].param_groups[0]["lr"]),
            num_optimizer_steps=steps,
            num_skipped=skipped,
            moe_load_balancing_loss=_mean_of([r.load_balancing for r in router]),
            moe_z_loss=_mean_of([r.z_loss for r in router]),
            moe_router_agreement=agreement,
        )
        return stats, None if log_probs is None else log_probs[:, :width]

    def _optimizer_step(
        self,
        mini: TrainBatch,
        settings: PolicyLossSettings,
        micro_batch_size: int,
        on_nonfinite: str,
        token_budget: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One optimizer step on a mini-batch: [6] metrics (global), or None when skipped as non-finite; and
        with ``settings.on_policy`` the forward's [rows, S] log-probs on the last stage (even when skipped)."""
        ctx = self.ctx
        self.engine.seed_dropout(self.scheduler.num_steps)
        mask = mini.response_mask
        counts = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().float()])
        ctx.all_reduce(counts, ctx.dp_group)  # global counts of this mini-batch
        parts = micro_parts(ctx.layout, mini, micro_batch_size, token_budget)
        micro: list[MicroBatch] = [
            self._packed(
                PolicyMicroBatch(
                    part.tokens, positions(part.tokens), expert_choices=part.expert_choices, train=part
                ),
                part.response_mask,
            )
            for _, part in parts
        ]
        self.engine.zero_grad()
        loss_fn = policy_loss(settings, counts[0].clamp(min=1), counts[1].clamp(min=1))
        out = self.engine.forward_backward(micro, loss_fn)
        log_probs = None
        if settings.on_policy and out:
            forward = [m.log_probs for m in out if m.log_probs is not None]
            log_probs = at_rows(forward, [rows for rows, _ in parts], mask.shape)
        local = torch.stack([m.summable() for m in out]).sum(0) if out else torch.zeros(len(POLICY_METRICS))
        if not self.engine.finite_or_skip(local, on_nonfinite, "loss"):
            return None, log_probs
        self.scheduler.step(1)  # the k-th update runs at the schedule's k-th learning rate
        result = self.engine.step()
        if out:
            ctx.all_reduce(local, ctx.dp_group)
        return torch.cat([local, torch.tensor([result.grad_norm])]), log_probs

    @contextlib.contextmanager
    def _routing_counted(self, counted: bool) -> Iterator[None]:
        """MoE models: within the block the routers count how often they agree with the rollout's choices."""
        routing = self.engine.routing
        if routing is None or not counted:
            yield
            return
        routing.counts.active = True
        try:
            yield
        finally:
            routing.counts.active = False


def _mean_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
