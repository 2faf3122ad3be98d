"""DPO on the train engine: the micro-batch record and the loss functions the pipeline schedule calls.

A micro-batch holds whole pairs: ``m`` chosen rows then their ``m`` rejected rows, so each pair's loss is
computed in one place (the last pipeline stage) from both of its sequence log-probs. Log-probs come from the
fused vocab-parallel op on the TP-sharded logits; nothing gathers the vocabulary.

Contract (:mod:`mcore_rl.engine.train_engine`): a micro-batch returns its share of the *global* loss, the mean
over every pair of the optimizer step on every data-parallel rank (``global_pairs``). Metrics are shares of the
same mean, so summing them over micro-batches and DP ranks gives TRL's per-step values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algo import DPOSettings, dpo_loss, sequence_log_probs
from mcore_rl.engine.train_engine import LossFn, MicroBatch
from mcore_rl.engine.workers.losses import token_log_probs
from mcore_rl.parallel.context import ParallelContext

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logps/accuracies",
)
"""Per-step metrics, TRL's names (evaluation prefixes them with ``eval_``), plus ``logps/accuracies``: how often
the policy itself gives the chosen completion the higher log-prob. TRL's ``rewards/accuracies`` compares
against the reference, so it reads 0 (all ties) before the first step; this one starts where the model is."""


@dataclass(frozen=True)
class SequenceLogProbs:
    """What the forward-only reference pass returns for one micro-batch."""

    logps: torch.Tensor
    """[2m] float32: each row's summed completion log-prob (chosen rows first)."""


@dataclass(frozen=True)
class DPOLossMetrics:
    """One micro-batch's share of the step's mean over pairs of each of :data:`METRICS`, in that order."""

    loss: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor
    rewards_accuracies: torch.Tensor
    rewards_margins: torch.Tensor
    logps_chosen: torch.Tensor
    logps_rejected: torch.Tensor
    logps_accuracies: torch.Tensor

    def summable(self) -> torch.Tensor:
        """[8] the shares as one tensor, in :data:`METRICS` order (field ``a_b`` is metric ``a/b``)."""
        return torch.stack([getattr(self, name.replace("/", "_")).float() for name in METRICS])


@dataclass
class PairMicroBatch(MicroBatch):
    """``m`` pairs as ``2m`` rows (chosen rows first); see the module docstring."""

    loss_mask: torch.Tensor | None = None  # [2m, s] float32: positions predicting completion tokens
    ref_log_probs: torch.Tensor | None = None  # [2m] float32 summed reference log-probs (last stage only)
    pair_weights: torch.Tensor | None = None  # [m] float32: 1 for a real pair, 0 for padding

    @property
    def num_pairs(self) -> int:
        return self.tokens.shape[0] // 2


@dataclass(frozen=True)
class DPOLossSettings:
    """The DPO objective on the engine."""

    dpo: DPOSettings
    """Loss type, beta, label smoothing, reference-free."""
    vocab_size: int
    """Real vocabulary (megatron's padding columns are left out of the softmax)."""
    sft_loss_weight: float = 0.0
    """Weight of the chosen completion's per-token NLL added to each pair's loss (RPO)."""


def _sequence_log_probs(output: torch.Tensor, mb: PairMicroBatch, ctx: ParallelContext, vocab_size: int):
    assert mb.loss_mask is not None
    token, _ = token_log_probs(output, mb.tokens, ctx, vocab_size, 1.0)
    return sequence_log_probs(token, mb.loss_mask)  # [2m] sums, [2m] completion lengths


def sequence_log_prob_loss(ctx: ParallelContext, vocab_size: int) -> LossFn[SequenceLogProbs]:
    """Forward-only: each row's summed completion log-prob [2m], a zero loss."""

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, SequenceLogProbs]:
        assert isinstance(mb, PairMicroBatch)
        with torch.no_grad():
            logps, _ = _sequence_log_probs(output.float(), mb, ctx, vocab_size)
        return output.sum() * 0, SequenceLogProbs(logps)

    return loss_fn


def dpo_pair_loss(
    settings: DPOLossSettings, ctx: ParallelContext, global_pairs: torch.Tensor
) -> LossFn[DPOLossMetrics]:
    """The DPO loss of a micro-batch as its share of the mean over ``global_pairs`` pairs, with TRL's metrics."""

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, DPOLossMetrics]:
        assert isinstance(mb, PairMicroBatch) and mb.ref_log_probs is not None and mb.pair_weights is not None
        m = mb.num_pairs
        logps, lengths = _sequence_log_probs(output, mb, ctx, settings.vocab_size)
        ref = mb.ref_log_probs.to(logps.dtype)
        out = dpo_loss(logps[:m], logps[m:], ref[:m], ref[m:], settings.dpo, lengths[:m], lengths[m:])
        per_pair = out.losses
        if settings.sft_loss_weight:
            per_pair = per_pair - settings.sft_loss_weight * logps[:m] / lengths[:m].clamp(min=1)
        weights = mb.pair_weights.to(logps.dtype)
        loss = (per_pair * weights).sum() / global_pairs
        chosen, rejected = logps[:m].detach(), logps[m:].detach()

        def share(values: torch.Tensor) -> torch.Tensor:
            return (values * weights).sum() / global_pairs

        return loss, DPOLossMetrics(
            loss=share(per_pair.detach()),
            rewards_chosen=share(out.chosen_rewards),
            rewards_rejected=share(out.rejected_rewards),
            rewards_accuracies=share((out.chosen_rewards > out.rejected_rewards).to(logps.dtype)),
            rewards_margins=share(out.chosen_rewards - out.rejected_rewards),
            logps_chosen=share(chosen),
            logps_rejected=share(rejected),
            logps_accuracies=share((chosen > rejected).to(logps.dtype)),
        )

    return loss_fn
