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

from mcore_rl.algo import LossAggregation, gspo_policy_loss, kl_loss, ppo_policy_loss, value_loss
from mcore_rl.algo.settings import PolicyLossMode
from mcore_rl.engine.lm_head import HeadLoss, LMHeadInput
from mcore_rl.engine.train_engine import LossFn, MicroBatch
from mcore_rl.ops import vocab_parallel_logprob_entropy
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import TrainBatch, ValueBatch


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


@dataclass
class ValueMicroBatch(MicroBatch):
    """A critic micro-batch: the model inputs plus its rows of the value batch."""

    values: ValueBatch | None = None


@dataclass(frozen=True)
class TokenLogProbs:
    """What the forward-only log-prob pass returns for one micro-batch."""

    log_probs: torch.Tensor
    """[b, s] float32: the log-prob of the next token where the mask reads, 0 elsewhere."""
    entropy: torch.Tensor
    """[b, s] float32: the entropy there, 0 elsewhere."""


@dataclass(frozen=True)
class PolicyLossMetrics:
    """One micro-batch's share of its mini-batch's policy-loss metrics: summed over micro-batches and
    data-parallel ranks they give the mini-batch's values (``pg_loss`` and ``kl_loss`` are shares of the
    global loss; the others token-weighted shares of a token mean)."""

    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    """0 without the KL loss."""
    entropy: torch.Tensor
    clip_frac: torch.Tensor
    clip_frac_lower: torch.Tensor
    """The share of tokens the dual clip (``clip_ratio_c``) bounded (verl's ``pg_clipfrac_lower``)."""
    approx_kl: torch.Tensor
    log_probs: torch.Tensor | None = None
    """[b, s] this forward's log-probs (``PolicyLossSettings.on_policy`` only), detached."""

    def summable(self) -> torch.Tensor:
        """[6] the shares as one tensor, in :data:`POLICY_METRICS` order."""
        return torch.stack([getattr(self, name).detach().float().reshape(()) for name in POLICY_METRICS])


POLICY_METRICS = ("pg_loss", "kl_loss", "entropy", "clip_frac", "clip_frac_lower", "approx_kl")
"""The summed fields of :class:`PolicyLossMetrics`, in the order the update stats are built from."""


@dataclass(frozen=True)
class SFTLossMetrics:
    loss: torch.Tensor
    """This micro-batch's share of the step's token-mean negative log-likelihood."""


@dataclass(frozen=True)
class Values:
    """What a forward-only value pass returns for one micro-batch."""

    values: torch.Tensor
    """[b, s] float32: the value head's output at every position."""


@dataclass(frozen=True)
class ValueLossMetrics:
    """One micro-batch's share of its mini-batch's critic metrics (summed as :class:`PolicyLossMetrics`)."""

    vf_loss: torch.Tensor
    vf_clip_frac: torch.Tensor
    vpred_mean: torch.Tensor

    def summable(self) -> torch.Tensor:
        parts = (self.vf_loss, self.vf_clip_frac, self.vpred_mean)
        return torch.stack([t.detach().float().reshape(()) for t in parts])


@dataclass(frozen=True)
class PolicyLossSettings:
    """The PPO-style actor loss (filled from ``AlgorithmConfig`` and the rollout temperature)."""

    vocab_size: int
    """Real vocabulary (megatron's padding columns are left out)."""
    temperature: float
    """Sampling temperature: log-probs are of ``softmax(logits / T)``, as the rollout engine reports."""
    loss_mode: str = PolicyLossMode.VANILLA.value
    """vanilla (PPO's token ratio) or gspo (the sequence ratio, seq-mean-token-mean over the global sequences)."""
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


def log_prob_loss(vocab_size: int, temperature: float) -> HeadLoss[TokenLogProbs]:
    """Forward-only: the log-probs and entropy at the micro-batch's mask, a zero loss."""

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, TokenLogProbs]:
        assert isinstance(mb, LogProbMicroBatch) and mb.mask is not None
        log_probs, entropy = head.token_log_probs(mb.tokens, mb.mask != 0, vocab_size, temperature)
        return log_probs.sum() * 0, TokenLogProbs(log_probs, entropy)

    return HeadLoss(loss_fn)


def policy_loss(
    settings: PolicyLossSettings, global_tokens: torch.Tensor, global_seqs: torch.Tensor
) -> HeadLoss[PolicyLossMetrics]:
    """PPO-clip (+ KL to the reference, - entropy bonus) over response tokens; ``global_*`` are the
    mini-batch's counts over every micro-batch and data-parallel rank."""
    agg = LossAggregation(
        settings.loss_agg_mode,
        global_num_tokens=global_tokens,
        global_num_seqs=global_seqs,
        norm_constant=settings.norm_constant,
    )
    token_mean = LossAggregation("token-mean", global_num_tokens=global_tokens)

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, PolicyLossMetrics]:
        assert isinstance(mb, PolicyMicroBatch) and mb.train is not None
        batch = mb.train
        mask = batch.response_mask
        log_probs, entropy = head.token_log_probs(
            mb.tokens, mask != 0, settings.vocab_size, settings.temperature
        )
        old_log_probs = log_probs.detach() if settings.on_policy else batch.old_log_probs
        ratios = (log_probs, old_log_probs, batch.advantages, mask)
        low, high = settings.clip_ratio_low, settings.clip_ratio_high
        if settings.loss_mode == PolicyLossMode.GSPO:
            pg = gspo_policy_loss(
                *ratios, clip_ratio_low=low, clip_ratio_high=high, global_num_seqs=global_seqs
            )
        else:
            c = settings.clip_ratio_c
            pg = ppo_policy_loss(*ratios, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, agg=agg)
        loss, kl_term = pg.loss, torch.zeros(())
        if settings.use_kl_loss:
            kl_term = kl_loss(log_probs, batch.ref_log_probs, mask, settings.kl_loss_type, agg)
            loss = loss + settings.kl_loss_coef * kl_term
        if settings.entropy_coeff:
            loss = loss - settings.entropy_coeff * agg.aggregate(entropy, mask)
        share = mask.sum() / global_tokens  # this micro-batch's fraction of the mini-batch's tokens
        return loss, PolicyLossMetrics(
            pg_loss=pg.loss.detach().clone(),
            kl_loss=kl_term.detach().clone(),
            entropy=token_mean.aggregate(entropy.detach(), mask),
            clip_frac=pg.clip_frac * share,
            clip_frac_lower=pg.clip_frac_lower * share,
            approx_kl=pg.approx_kl * share,
            log_probs=log_probs.detach() if settings.on_policy else None,
        )

    return HeadLoss(loss_fn)


def sft_loss(vocab_size: int, global_tokens: torch.Tensor) -> HeadLoss[SFTLossMetrics]:
    """Token-mean negative log-likelihood of the target tokens (prompt positions masked out)."""

    def loss_fn(head: LMHeadInput, mb: MicroBatch) -> tuple[torch.Tensor, SFTLossMetrics]:
        assert isinstance(mb, SFTMicroBatch) and mb.loss_mask is not None
        log_probs, _ = head.token_log_probs(mb.tokens, mb.loss_mask != 0, vocab_size, 1.0)
        loss = -(log_probs * mb.loss_mask).sum() / global_tokens
        return loss, SFTLossMetrics(loss.detach().clone())

    return HeadLoss(loss_fn)


def forward_values_loss() -> LossFn[Values]:
    """Forward-only: the per-position values [b, s], a zero loss."""

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, Values]:
        return output.sum() * 0, Values(output[..., 0].detach().float())

    return loss_fn


def critic_loss(cliprange_value: float, global_tokens: torch.Tensor) -> LossFn[ValueLossMetrics]:
    """The clipped value loss as this micro-batch's share of the mini-batch's token mean (the engine's
    contract); the metrics are shares too, so their sum over micro-batches and DP ranks is the global mean."""
    agg = LossAggregation("token-mean", global_num_tokens=global_tokens)

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, ValueLossMetrics]:
        assert isinstance(mb, ValueMicroBatch) and mb.values is not None
        batch, pred = mb.values, output[..., 0].float()
        out = value_loss(
            pred,
            batch.old_values,
            batch.returns,
            batch.response_mask,
            clip_range_value=cliprange_value,
            agg=agg,
        )
        mask = batch.response_mask
        share = mask.sum() / global_tokens
        return out.loss, ValueLossMetrics(
            vf_loss=out.loss.detach().clone(),
            vf_clip_frac=out.clip_frac * share,
            vpred_mean=agg.aggregate(pred.detach(), mask),
        )

    return loss_fn
