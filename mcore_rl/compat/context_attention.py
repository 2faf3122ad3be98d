"""Causal attention under context parallelism (CP) without Transformer Engine: the local layer spec's core
attention when every sequence is split over the ranks of a CP group.

Data layout, as megatron's (``megatron.core.utils.get_batch_on_this_cp_rank``; for packed ``thd`` rows TE's
``thd_get_partitioned_indices``): each segment (a padded row, or one row of a packed sequence) of length
``L``, a multiple of ``2 * cp``, is cut into ``2 * cp`` chunks of ``c = L / (2 * cp)`` tokens, and CP rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order, segment after segment. Under a causal mask
chunk ``g`` attends to the ``g + 1`` chunks before and including itself, so every rank does the same work
(``(r + 1) + (2 * cp - r) = 2 * cp + 1`` chunk pairs), which a plain split would not.

The exchange is an all-gather of keys and values over the CP group (megatron's ``cp_comm_type="all_gather"``,
not TE's default ring of point-to-point blocks): each rank gathers every other rank's K and V once per layer
and computes its own two chunks of queries against the keys they may see. Its backward is the reduce-scatter
of the K / V gradients back to the ranks that own them. It costs one full-sequence K and V per rank and
layer (kept for backward), against the ring's one block at a time; with grouped-query attention K and V are
a small share of the activations (``planner/activations.py`` counts them).

:func:`context_attention` is the pure part (every token's K and V in sequence order in, this rank's output
out), tested against a plain fp64 attention; :func:`gather_sequence` is the collective that feeds it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of ``2 * cp`` chunks of every segment that CP rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


@functools.lru_cache(maxsize=64)
def _local_index(segments: tuple[int, ...], cp: int, rank: int) -> Tensor:
    parts, start = [], 0
    for length in segments:
        if length % (2 * cp):
            raise ValueError(
                f"a sequence of {length} tokens does not split into 2 x context_parallel_size={cp} equal chunks"
            )
        c = length // (2 * cp)
        parts += [torch.arange(start + g * c, start + (g + 1) * c) for g in chunk_ids(cp, rank)]
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def local_token_index(segments: Sequence[int], cp: int, rank: int) -> Tensor:
    """[sum(segments) / cp] int64: the positions (in the whole sequence of ``segments`` laid end to end) of the
    tokens CP rank ``rank`` holds, in the order it holds them (module docstring)."""
    return _local_index(tuple(int(n) for n in segments), cp, rank)


@functools.lru_cache(maxsize=64)
def _natural_order(segments: tuple[int, ...], cp: int) -> Tensor:
    held = torch.cat([_local_index(segments, cp, r) for r in range(cp)])
    return torch.argsort(held)


def natural_order(segments: Sequence[int], cp: int) -> Tensor:
    """[sum(segments)] int64: for each position of the sequence, where it sits in the concatenation of every
    CP rank's tokens in rank order (what an all-gather over the CP group returns)."""
    return _natural_order(tuple(int(n) for n in segments), cp)


def gather_sequence(local: Tensor, segments: Sequence[int], group: Any, dim: int) -> Tensor:
    """Every CP rank's ``local`` tokens (along ``dim``) gathered over ``group`` and put in sequence order;
    differentiable: the backward sums each token's gradient over the ranks that read it and hands it to the
    rank that owns the token (megatron's all-gather with a reduce-scatter backward)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    moved = local.movedim(dim, 0)
    gathered = gather_from_sequence_parallel_region(moved.contiguous(), True, group)
    order = natural_order(segments, group.size()).to(local.device)
    return gathered.index_select(0, order).movedim(0, dim)


def _chunk_mask(q_start: int, num_q: int, num_k: int, window: int | None, device: torch.device) -> Tensor:
    """[num_q, num_k] bool: query at position ``q_start + i`` may see key ``j`` (causal, and within the
    sliding window of ``window + 1`` positions when given)."""
    q = torch.arange(q_start, q_start + num_q, device=device)[:, None]
    k = torch.arange(num_k, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k <= window
    return allowed


class _ChunkAttention(torch.autograd.Function):
    """One chunk of queries (``q_start`` its first position) against the keys before and including it, causal
    (and windowed), that keeps only its inputs for backward and recomputes the attention there. torch's
    attention with an explicit mask saves the mask as a float [c, (g + 1) c] tensor, quadratic in the
    sequence as the scores are; the mask is cheap to rebuild, so backward pays one more attention forward
    instead (megatron's selective recompute of core attention, for this kernel)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_start: int,
        window: int | None,
        scale: float | None,
        gqa: bool,
    ) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.settings = (q_start, window, scale, gqa)
        return _masked_attention(q, k, v, q_start, window, scale, gqa)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = _masked_attention(*inputs, *ctx.settings)
        grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None, None, None)


def _masked_attention(
    q: Tensor, k: Tensor, v: Tensor, q_start: int, window: int | None, scale: float | None, gqa: bool
) -> Tensor:
    mask = _chunk_mask(q_start, q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def context_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Sequence[int],
    cp: int,
    rank: int,
    scale: float | None,
    window: int | None = None,
) -> Tensor:
    """Causal attention of CP rank ``rank``'s queries against every key they may see.

    ``query`` [b, heads, T / cp, d]: this rank's tokens of every segment (chunks ``rank`` and
    ``2 cp - 1 - rank`` of each, in that order); ``key`` / ``value`` [b, groups, T, d]: every token in
    sequence order; ``segments``: the segments' lengths (sum T, each a multiple of ``2 cp``); ``window``: a
    sliding window, megatron's ``window_size[0]`` (a query sees itself and ``window`` positions back).
    Returns [b, heads, T / cp, d], this rank's outputs in its order.
    """
    gqa = key.shape[1] != query.shape[1]
    outputs, local, start = [], 0, 0
    for length in segments:
        c = length // (2 * cp)
        for g in chunk_ids(cp, rank):
            q = query[:, :, local : local + c]
            end = start + (g + 1) * c  # keys up to the chunk's last position
            k, v = key[:, :, start:end], value[:, :, start:end]
            outputs.append(_ChunkAttention.apply(q, k, v, g * c, window, scale, gqa))
            local += c
        start += length
    return torch.cat(outputs, dim=2)


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Sequence[int],
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Plain causal attention over whole segments, every operation spelled out (the test oracle, run in
    fp64): ``query`` [b, heads, T, d], ``key`` / ``value`` [b, groups, T, d] in sequence order -> [b, heads,
    T, d]."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out, start = torch.zeros_like(query), 0
    for length in segments:
        part = slice(start, start + length)
        scores = query[:, :, part] @ key[:, :, part].transpose(-1, -2) * scale
        mask = _chunk_mask(0, length, length, window, query.device)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[:, :, part] = probs @ value[:, :, part]
        start += length
    return out


def pos_emb_on_this_cp_rank(pos_emb: Tensor, seq_dim: int, cp_group: Any) -> Tensor:
    """megatron's ``get_pos_emb_on_this_cp_rank`` (rotary angles of this CP rank's two chunks) without its
    pinned-memory index, which a CPU-only torch refuses ("pin_memory=True requires a CUDA ...")."""
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor(chunk_ids(cp, rank), device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])
