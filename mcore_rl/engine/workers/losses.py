"""The actor's loss functions for the train engine, reading typed micro-batches.

Contract (see :mod:`mcore_rl.engine.train_engine`): each micro-batch returns its share of the *global*
mini-batch loss, so the aggregation gets the global token / sequence counts (summed over micro-batches and
data-parallel ranks by the worker). Metrics are returned as shares too (a masked mean times local tokens
over global tokens), so summing them over micro-batches and DP ranks gives the global token mean.

The actor's losses are :class:`HeadLoss` es: they project only the positions their mask reads (response tokens,
SFT targets) through the fused LM-head + log-prob op, so no [tokens x vocab] logits exist; positions off the
mask get log-prob and entropy 0, which the algorithms never read (``mcore_rl.algo`` zeroes them anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algo import LossAggregation, kl_loss, ppo_policy_loss
from mcore_rl.engine.train_engine import HeadLoss, LMHeadInput, MicroBatch
from mcore_rl.ops import vocab_parallel_logprob_entropy
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import TrainBatch


@dataclass
class PolicyMicroBatch(MicroBatch):
    """A micro-batch of the actor: the model inputs plus its rows of the train batch."""

    train: TrainBatch | None = None


@dataclass
class LogProbMicroBatch(MicroBatch):
    """A forward-only micro-batch: the model inputs plus the positions whose next-token log-prob is wanted."""

    mask: torch.Tensor | None = None  # [b, s] float32 or bool, e.g. a rollout's response mask


@dataclass
class SFTMicroBatch(MicroBatch):
    """A supervised micro-batch: the model inputs plus the mask of positions that predict target tokens."""

    loss_mask: torch.Tensor | None = None  # [b, s] float32


@dataclass(frozen=True)
class PolicyLossSettings:
    """The PPO-style actor loss (filled from ``AlgorithmConfig`` and the rollout temperature)."""

    vocab_size: int
    """Real vocabulary (megatron's padding columns are left out)."""
    temperature: float
    """Sampling temperature: log-probs are of ``softmax(logits / T)``, as the rollout engine reports."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    norm_constant: float | None = None
    """Divisor of seq-mean-token-sum-norm (the max response length)."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    on_policy: bool = False
    """The old log-probs are this forward's own, detached (``TrainBatch.old_log_probs`` is not read): the
    ratio is exactly 1 and its gradient the policy gradient. Valid only for one optimizer step on a rollout
    of the current weights, and because our models run without dropout (``engine/model.py``): this
    train-mode forward is then the function the forward-only pass it replaces computes. The loss also
    returns its ``log_probs`` [b, s] as a metric."""


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, ctx: ParallelContext, vocab_size: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, s] log-prob of the next token, [b, s] entropy) from vocab-sharded logits [b, s, V/tp]."""
    shard = logits.shape[-1]
    labels = torch.roll(tokens, -1, dims=1)  # the last column wraps around; it is never on the mask
    log_probs, entropy = vocab_parallel_logprob_entropy(
        logits.reshape(-1, shard),
        labels.reshape(-1),
        vocab_start=ctx.tp_rank * shard,
        vocab_size=vocab_size,
        temperature=temperature,
        tp_group=ctx.tp_group if ctx.tp_size > 1 else None,
    )
    return log_probs.view(tokens.shape), entropy.view(tokens.shape)


def log_prob_loss(vocab_size: int, temperature: float) -> HeadLoss:
    """Forward-only: the log-probs and entropy at the micro-batch's mask as [b, s] metrics, a zero loss."""

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert isinstance(mb, LogProbMicroBatch) and mb.mask is not None
        log_probs, entropy = head.token_log_probs(mb.tokens, mb.mask != 0, vocab_size, temperature)
        return log_probs.sum() * 0, {"log_probs": log_probs, "entropy": entropy}

    return HeadLoss(loss_fn)


def policy_loss(
    settings: PolicyLossSettings, global_tokens: torch.Tensor, global_seqs: torch.Tensor
) -> HeadLoss:
    """PPO-clip (+ KL to the reference, - entropy bonus) over response tokens; ``global_*`` are the
    mini-batch's counts over every micro-batch and data-parallel rank."""
    agg = LossAggregation(
        settings.loss_agg_mode,
        global_num_tokens=global_tokens,
        global_num_seqs=global_seqs,
        norm_constant=settings.norm_constant,
    )
    token_mean = LossAggregation("token-mean", global_num_tokens=global_tokens)

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert isinstance(mb, PolicyMicroBatch) and mb.train is not None
        batch = mb.train
        mask = batch.response_mask
        log_probs, entropy = head.token_log_probs(
            mb.tokens, mask != 0, settings.vocab_size, settings.temperature
        )
        old_log_probs = log_probs.detach() if settings.on_policy else batch.old_log_probs
        pg = ppo_policy_loss(
            log_probs,
            old_log_probs,
            batch.advantages,
            mask,
            clip_ratio_low=settings.clip_ratio_low,
            clip_ratio_high=settings.clip_ratio_high,
            clip_ratio_c=settings.clip_ratio_c,
            agg=agg,
        )
        loss = pg.loss
        share = mask.sum() / global_tokens  # this micro-batch's fraction of the mini-batch's tokens
        metrics = {
            "pg_loss": pg.loss.detach().clone(),
            "clip_frac": pg.clip_frac * share,
            "approx_kl": pg.approx_kl * share,
            "entropy": token_mean.aggregate(entropy.detach(), mask),
            "kl_loss": torch.zeros(()),
        }
        if settings.on_policy:
            metrics["log_probs"] = log_probs.detach()
        if settings.use_kl_loss:
            kl = kl_loss(log_probs, batch.ref_log_probs, mask, settings.kl_loss_type, agg)
            loss = loss + settings.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach().clone()
        if settings.entropy_coeff:
            loss = loss - settings.entropy_coeff * agg.aggregate(entropy, mask)
        return loss, metrics

    return HeadLoss(loss_fn)


def sft_loss(vocab_size: int, global_tokens: torch.Tensor) -> HeadLoss:
    """Token-mean negative log-likelihood of the target tokens (prompt positions masked out)."""

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert isinstance(mb, SFTMicroBatch) and mb.loss_mask is not None
        log_probs, _ = head.token_log_probs(mb.tokens, mb.loss_mask != 0, vocab_size, 1.0)
        loss = -(log_probs * mb.loss_mask).sum() / global_tokens
        return loss, {"loss": loss.detach().clone()}

    return HeadLoss(loss_fn)
