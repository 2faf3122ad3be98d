"""Context parallelism in the train engine: each CP rank runs the model on its share of a micro-batch's tokens,
and the outputs are gathered back into the micro-batch's [b, s] rows before any loss reads them.

The split is megatron's (``compat/context_attention.py``): every segment, a padded row or one row of a packed
(``thd``) sequence, is cut into ``2 x CP`` chunks and CP rank r runs chunks r and 2CP-1-r. Packed rows are
first padded one by one to a multiple of ``2 x CP`` (times TP with sequence parallelism), as megatron-LM pads
its ``thd`` batches for CP; the padding tokens sit after each row's last token, so causal attention keeps
them out of every real position, and no loss reads them.

What the losses see does not change (``engine/train_engine.py``'s contract holds as it is): the gathered
[b, s] outputs (log-probs and entropy from the LM head, values, logits) are the same on every CP rank, each
rank computes the same loss over them, normalised by the same global token count, and the gather's backward
hands each rank the gradient of its own tokens only. Summed over DP x CP, as megatron's DDP reduces the
gradients of CP ranks, that is exactly the gradient of the global loss. The LM head (``engine/lm_head.py``)
still projects only this rank's tokens (the fused log-prob op per CP shard); only [tokens] log-probs cross
the CP group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.compat.context_attention import local_token_index
from mcore_rl.engine.packed_seq import packed_seq_params
from mcore_rl.parallel.context import ParallelContext

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import MicroBatch


@dataclass(frozen=True)
class ContextShard:
    """This CP rank's share of one micro-batch: its model input, and where the model's outputs go."""

    tokens: torch.Tensor
    """[b, s / cp] (padded rows) or [1, T / cp] (packed) int64: the tokens this rank runs."""
    position_ids: torch.Tensor
    """Their positions, in the same layout."""
    seq_params: Any
    """megatron's ``PackedSeqParams`` of the whole packed sequence, each row padded to the multiple (the
    attention and the rotary embedding read the global ``cu_seqlens``); None for padded rows."""
    rows: torch.Tensor
    """[n] int64: for each of this rank's tokens, in the order the model returns them, its place in the
    flattened [b, s] rows; ``b * s`` for padding no row holds."""
    all_rows: torch.Tensor
    """[cp * n] int64: ``rows`` of every CP rank, in rank order (the order of a gather over the group)."""
    shape: tuple[int, int]
    """(b, s) of the micro-batch's rows."""
    group: Any
    """The CP process group."""


def context_shards(micro_batches: list[MicroBatch], ctx: ParallelContext) -> list[MicroBatch]:
    """Each micro-batch with its :class:`ContextShard` for this rank (``MicroBatch.context``); as they are
    without context parallelism."""
    if ctx.cp_size == 1:
        return micro_batches
    return [dataclasses.replace(mb, context=_shard(mb, ctx)) for mb in micro_batches]


def _shard(mb: MicroBatch, ctx: ParallelContext) -> ContextShard:
    cp, multiple = ctx.cp_size, ctx.sequence_multiple
    b, s = mb.tokens.shape
    if mb.packed is None:
        if s % multiple:
            raise ValueError(
                f"a micro-batch of {s} columns does not split over context_parallel_size={cp}: rows must be "
                f"padded to a multiple of 2 x CP{' x TP (sequence_parallel)' if ctx.layout.sp else ''} = "
                f"{multiple} (ParallelContext.sequence_multiple)"
            )
        flat = (torch.arange(b)[:, None] * s + torch.arange(s)[None]).to(mb.tokens.device)
        held = [local_token_index([s], cp, r).to(mb.tokens.device) for r in range(cp)]
        mine = held[ctx.cp_rank]
        return ContextShard(
            tokens=mb.tokens[:, mine],
            position_ids=mb.position_ids[:, mine],
            seq_params=None,
            rows=flat[:, mine].reshape(-1),
            all_rows=torch.cat([flat[:, h].reshape(-1) for h in held]),
            shape=(b, s),
            group=ctx.cp_group,
        )
    return _packed_shard(mb, ctx)


def _packed_shard(mb: MicroBatch, ctx: ParallelContext) -> ContextShard:
    """A packed micro-batch's share: each segment padded to the multiple, then split as one sequence."""
    packed = mb.packed
    assert packed is not None
    if packed.source is not None or getattr(packed.seq_params, "token_home", None) is not None:
        raise ValueError(
            "model.share_prompt_prefix does not support context parallelism (parallel.context_parallel_size > 1)"
        )
    cp, multiple = ctx.cp_size, ctx.sequence_multiple
    b, s = mb.tokens.shape
    device = packed.tokens.device
    lengths = torch.diff(packed.seq_params.cu_seqlens_q).tolist()
    source_rows = torch.full((packed.tokens.shape[1],), b * s, dtype=torch.long, device=device)
    source_rows[: packed.index.numel()] = packed.index  # filler tokens belong to no row
    tokens, rows, positions, widths, start = [], [], [], [], 0
    for length in lengths:
        width = -(-length // multiple) * multiple
        pad = width - length
        tokens += [packed.tokens[0, start : start + length], packed.tokens.new_zeros(pad)]
        rows += [source_rows[start : start + length], source_rows.new_full((pad,), b * s)]
        positions.append(torch.arange(width, device=device))
        widths.append(width)
        start += length
    all_tokens, all_rows, all_positions = torch.cat(tokens), torch.cat(rows), torch.cat(positions)
    held = [local_token_index(widths, cp, r).to(device) for r in range(cp)]
    mine = held[ctx.cp_rank]
    return ContextShard(
        tokens=all_tokens[mine][None],
        position_ids=all_positions[mine][None],
        seq_params=packed_seq_params(widths, padded=True, device=device),
        rows=all_rows[mine],
        all_rows=torch.cat([all_rows[h] for h in held]),
        shape=(b, s),
        group=ctx.cp_group,
    )


def gather_rows(local: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """[n, X] outputs of this rank's tokens -> [b, s, X] outputs of every row, the same on every CP rank (0 at
    positions no rank ran). Differentiable: the backward keeps the gradient of this rank's own tokens (every
    CP rank computes the same loss over the gathered rows, see the module docstring)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(local.contiguous(), False, shard.group)
    b, s = shard.shape
    rows = gathered.new_zeros(b * s + 1, local.shape[-1]).index_copy(0, shard.all_rows, gathered)
    return rows[: b * s].view(b, s, local.shape[-1])
