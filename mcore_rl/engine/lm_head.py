"""The language-model head seen by a :class:`HeadLoss`: the last stage hands the loss its final hidden states
and its vocab shard of the output weight instead of logits, so a loss reading log-probs at a few positions
projects only those (the fused ``linear_logprob_entropy`` op streams vocab chunks; the [tokens x vocab] logits
are never materialised). ``engine/train_engine.py`` runs it inside megatron's schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from mcore_rl.engine.context_parallel import ContextShard, gather_rows
from mcore_rl.io.host import host_memory_limit, ranks_on_this_host
from mcore_rl.ops import linear_logprob_entropy
from mcore_rl.parallel.context import ParallelContext

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import MicroBatch

M = TypeVar("M")


KEEP_LOGITS_SHARE = 16
"""On a CPU rank the LM head keeps logits up to the host's memory over this, over the ranks on the host."""


def keep_logits_bytes(setting: int | None, device: torch.device, world_size: int) -> int:
    """How many bytes of a micro-batch's logits the LM head's forward keeps for the backward, which then
    skips their GEMM (``model.keep_logits_gib``; the fused op recomputes the rest). ``None``: on a CPU rank
    1/16 of the host's memory (or cgroup limit) over its ranks, since there the recompute is about 10% of
    an update at a 32k vocab (one [tokens, h] x [h, V] GEMM more than the three of forward and backward) and
    memory is plentiful; on a GPU none, where memory is the scarce resource and the GEMM is cheap."""
    if setting is not None:
        return setting
    if device.type != "cpu":
        return 0
    return host_memory_limit() // KEEP_LOGITS_SHARE // max(1, ranks_on_this_host(world_size))


def describe_keep_logits(
    setting: int | None, device: torch.device, world_size: int, host_cache_off: bool = False
) -> str:
    """One line for the run's fast-path note: what :func:`keep_logits_bytes` chose and why (``host_cache_off``:
    the setting is 0 because the run's host cache is off, not because the key says so)."""
    kept = keep_logits_bytes(setting, device, world_size)
    if host_cache_off:
        chosen = "trainer.host_cache_gib=0, see model.keep_logits_gib"
    elif setting is not None:
        chosen = "model.keep_logits_gib"
    elif device.type == "cpu":
        chosen = f"1/{KEEP_LOGITS_SHARE} of memory / {max(1, ranks_on_this_host(world_size))} ranks"
    else:
        chosen = "none on a GPU"
    if kept == 0:
        return f"LM head: every logit recomputed in the backward ({chosen})"
    return f"LM head: up to {kept / (1 << 30):.1f} GiB of a micro-batch's logits kept for the backward ({chosen})"


@dataclass(frozen=True)
class LMHeadInput:
    """What a :class:`HeadLoss` gets on the last pipeline stage instead of logits."""

    hidden: torch.Tensor
    """[b, s, h] final hidden states (after the final norm), every position on every TP rank; its gradient is
    summed over TP in backward (each rank only sees its vocab shard). With context parallelism [n, h]: this
    CP rank's tokens only, in :attr:`context`'s order."""
    weight: torch.Tensor
    """[V_padded/tp, h] this rank's rows of the output layer (the embedding when they are tied)."""
    ctx: ParallelContext
    """The parallel layout (TP group and rank of the vocab shard)."""
    context: ContextShard | None = None
    """Context parallelism: where this CP rank's hidden states sit in the [b, s] rows."""
    keep_logits_bytes: int = 0
    """Logits the fused op's forward may keep for its backward (:func:`keep_logits_bytes`); 0 recomputes."""

    def token_log_probs(
        self, tokens: torch.Tensor, keep: torch.Tensor, vocab_size: int, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([b, s] log-prob of the next token, [b, s] entropy), computed only where ``keep`` [b, s] (bool) is
        set and 0 elsewhere; differentiable w.r.t. the hidden states and the output weight. With context
        parallelism each CP rank projects its own tokens, and the rows are gathered from every CP rank
        (the same on each; ``engine/context_parallel.py``)."""
        labels = torch.roll(tokens, -1, dims=1)  # the last column wraps around; never kept by a response mask
        if self.context is not None:
            return self._context_token_log_probs(labels, keep, vocab_size, temperature)
        log_probs, entropy = self._project(self.hidden[keep], labels[keep], vocab_size, temperature)
        zeros = torch.zeros(tokens.shape, dtype=log_probs.dtype, device=log_probs.device)
        return zeros.masked_scatter(keep, log_probs), zeros.masked_scatter(keep, entropy)

    def _project(
        self, hidden: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused op over [n, h] hidden states: ([n] log-probs of ``labels``, [n] entropy)."""
        return linear_logprob_entropy(
            hidden.to(self.weight.dtype),
            self.weight,
            labels,
            vocab_start=self.ctx.tp_rank * self.weight.shape[0],
            vocab_size=vocab_size,
            temperature=temperature,
            tp_group=self.ctx.tp_group if self.ctx.tp_size > 1 else None,
            keep_logits_bytes=self.keep_logits_bytes,
        )

    def _context_token_log_probs(
        self, labels: torch.Tensor, keep: torch.Tensor, vocab_size: int, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`token_log_probs` of a CP rank: the fused op over its kept tokens, then the [n, 2] log-probs
        and entropy of its tokens gathered into the rows."""
        shard = self.context
        assert shard is not None
        cells = labels.numel()
        real = shard.rows < cells  # padding of packed rows belongs to no row
        at = shard.rows.clamp(max=cells - 1)
        mine = keep.reshape(-1)[at] & real
        log_probs, entropy = self._project(
            self.hidden[mine], labels.reshape(-1)[at][mine], vocab_size, temperature
        )
        zeros = torch.zeros(shard.rows.shape, dtype=log_probs.dtype, device=log_probs.device)
        local = torch.stack([zeros.masked_scatter(mine, log_probs), zeros.masked_scatter(mine, entropy)], -1)
        rows = gather_rows(local, shard)  # [b, s, 2]
        return rows[..., 0], rows[..., 1]


@dataclass(frozen=True)
class HeadLoss(Generic[M]):
    """A loss over the final hidden states and the output weight (see the module docstring)."""

    fn: Callable[[LMHeadInput, MicroBatch], tuple[torch.Tensor, M]]
    """(head input, micro-batch) -> (loss scalar, record), as :data:`LossFn`."""


@contextmanager
def skip_output_layer(gpt: Any) -> Iterator[None]:
    """The last stage's GPTModel returns its final hidden states: with ``post_process`` off, megatron's
    ``_postprocess`` returns before the output layer (the final norm lives in the decoder block)."""
    if gpt.config.mtp_num_layers:
        raise ValueError("HeadLoss does not support multi-token prediction layers (mtp_num_layers)")
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def full_hidden(hidden: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """[b, s, h] on every TP rank, as megatron's column-parallel output layer sees its input: gathered over
    the sequence with SP; in backward the per-vocab-shard gradients are summed over TP either way."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if ctx.tp_size > 1:
        if ctx.layout.sp:
            hidden = gather_from_sequence_parallel_region(hidden, True, ctx.tp_group)
        else:
            hidden = _SumGradOverTP.apply(hidden, ctx.tp_group)
    return hidden.transpose(0, 1)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group. megatron's
    ``copy_to_tensor_model_parallel_region`` does the same only for a contiguous gradient: it all-reduces
    ``grad.contiguous()`` and returns ``grad``, so a strided one (ours arrives through the transpose above)
    came back unsummed, each rank training on its own vocab shard's share (the final norm drifted apart)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def output_weight(gpt: Any) -> torch.Tensor:
    """This rank's output-layer rows; the word embedding when tied and both live on this stage."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
