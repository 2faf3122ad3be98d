"""Fused vocab-parallel log-probs and entropy of target tokens, from logits or straight from hidden states.

With tensor parallelism each rank holds a vocab shard of the logits, columns ``[vocab_start, vocab_start +
V/tp)``. Per row, with ``z = logits / T`` over the real vocab (global ids ``>= vocab_size`` are megatron's
padding and are left out, as if they were -inf):

    stats pass, one streaming read of the shard (C++ / CUDA kernel ``logprob_stats``, fp32):
        m_r = max z,   s_r = sum e^(z - m_r),   w_r = sum e^(z - m_r) (z - m_r),   t_r = z_target or 0
    combine over the TP group (here, two all-reduces):
        m = all_reduce_MAX(m_r);  rebase (s_r, w_r) onto m;  (s, w, t) = all_reduce_SUM(s_r, w_r, t_r)
    finalise:
        lse = m + log s,   log p(target) = t - lse,   H = -sum p log p = log s - w / s

``H = log s + |w| / s`` adds two non-negative terms; verl's ``lse - sum p z`` subtracts two numbers the size of
the largest logit and loses ``eps * max|z|`` absolute precision.

Backward (no collective, no saved softmax; kernel ``logprob_entropy_backward``) recomputes ``p`` from the
saved per-row ``(lse, H)``. With ``g1``, ``g2`` the incoming gradients of log p(target) and H:

    d logp / dz_v = 1[v = y] - p_v,   dH / dz_v = -p_v (z_v - sum_u p_u z_u) = -p_v (log p_v + H)
    d / d logits_v = (g1 (1[v = y] - p_v) - g2 p_v (log p_v + H)) / T

Both ops are ``torch.library`` custom ops (``mcore_rl::vocab_parallel_logprob_entropy`` and
``mcore_rl::linear_logprob_entropy``) with fake kernels and registered autograd, built on the two native
kernels, or on their references in :mod:`mcore_rl.ops.reference` when the extension is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from mcore_rl.ops import _native, reference
from mcore_rl.ops.gemm import gemm_into

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per kernel call. It bounds the reference path's fp32 temporaries to chunk x V/tp; the native kernels
stream each row and need no temporaries at all."""
DEFAULT_VOCAB_CHUNK = 4096
"""Vocab columns per matmul in the fused linear variant: the largest logits block ever held is N x this."""


def _stats_fn(logits: Tensor) -> Callable[..., Tensor]:
    if _native.use_native(logits.device, logits.dtype):
        return torch.ops.mcore_rl.logprob_stats
    return reference.logprob_stats


def _backward_fn(logits: Tensor) -> Callable[..., None]:
    if _native.use_native(logits.device, logits.dtype):
        return torch.ops.mcore_rl.logprob_entropy_backward
    return reference.logprob_entropy_backward


def check_targets(targets: Tensor, vocab_size: int) -> None:
    """Refuse a target outside ``[0, vocab_size)`` (e.g. an ignore index of -100 or a pad id past the vocab).

    One device-to-host read per call, so it is skipped while a CUDA graph is being captured."""
    if targets.numel() == 0:
        return
    bad = (targets < 0) | (targets >= vocab_size)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(  # the CPU kernel's words
            f"mcore_rl: target id {int(targets[row])} of row {row} is outside [0, vocab_size={vocab_size}); "
            "targets must be real token ids"
        )


def _local_stats(
    logits: Tensor, targets: Tensor, vocab_start: int, vocab_size: int, inv_t: float, chunk_size: int
) -> Tensor:
    """[N, 4] statistics of this shard (see the module docstring), ``chunk_size`` rows per kernel call."""
    if logits.device.type != "cpu" and not torch.cuda.is_current_stream_capturing():
        check_targets(targets, vocab_size)  # the CUDA kernel returns NaN for them where the CPU one raises
    stats_fn = _stats_fn(logits)
    parts = []
    for start in range(0, logits.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        parts.append(stats_fn(logits[rows], targets[rows], vocab_start, vocab_size, inv_t))
    if not parts:
        return logits.new_empty((0, 4), dtype=reference.compute_dtype(logits.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rebase(stats: Tensor, new_max: Tensor) -> tuple[Tensor, Tensor]:
    """(s, w) of ``stats`` re-expressed relative to ``new_max`` >= their own max. Rows with s = 0 (a shard
    holding only padding or masked logits) stay 0 instead of turning into -inf * 0."""
    row_max, s, w = stats[:, 0], stats[:, 1], stats[:, 2]
    empty = s == 0
    shift = torch.where(empty, 0.0, row_max - new_max)
    scale = torch.exp(shift)
    return scale * s, torch.where(empty, 0.0, scale * (w + shift * s))


def _merge(a: Tensor, b: Tensor) -> Tensor:
    """Statistics of the union of two disjoint column sets (used for the vocab chunks of the linear op)."""
    new_max = torch.maximum(a[:, 0], b[:, 0])
    s_a, w_a = _rebase(a, new_max)
    s_b, w_b = _rebase(b, new_max)
    return torch.stack([new_max, s_a + s_b, w_a + w_b, a[:, 3] + b[:, 3]], dim=1)


def _reduce_over_tp(stats: Tensor, tp_group_name: str | None) -> Tensor:
    """Combines every rank's [N, 4] shard statistics into the full-vocab ones: MAX, then one SUM."""
    if tp_group_name is None:
        return stats
    # A custom-op schema cannot carry a ProcessGroup, so the group travels by name, as in torch's functional
    # collectives, and is looked up here (the name's type is a NewType of str in recent torch).
    group = dist.distributed_c10d._resolve_process_group(cast(Any, tp_group_name))
    # A copy, never a view: with one row, ``stats[:, 0]`` is already contiguous and ``.contiguous()`` would
    # alias it, so the in-place all-reduce would overwrite the local max that the rebase below still needs.
    new_max = stats[:, 0].clone()
    dist.all_reduce(new_max, op=dist.ReduceOp.MAX, group=group)
    s, w = _rebase(stats, new_max)
    sums = torch.stack([s, w, stats[:, 3]])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return torch.stack([new_max, sums[0], sums[1], sums[2]], dim=1)


def _finalize(stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target) [N], entropy [N], softmax_stats [N, 2] = (lse, entropy) saved for backward)."""
    row_max, s, w, target_z = stats.unbind(dim=1)
    log_s = torch.log(s)
    lse = row_max + log_s
    entropy = log_s - w / s
    return target_z - lse, entropy, torch.stack([lse, entropy], dim=1)


def _logits_grad(
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    logits: Tensor,
    targets: Tensor,
    softmax_stats: Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_t: float,
    chunk_size: int,
    out: Tensor | None = None,
) -> Tensor:
    """d(g1 . logprob + g2 . entropy) / d logits, ``chunk_size`` rows per kernel call, into ``out`` when
    given (a buffer shaped like ``logits``)."""
    zeros = torch.zeros_like(softmax_stats[:, 0])
    g1 = zeros if grad_logprob is None else grad_logprob.to(zeros.dtype).contiguous()
    g2 = zeros if grad_entropy is None else grad_entropy.to(zeros.dtype).contiguous()
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    backward_fn = _backward_fn(logits)
    for start in range(0, logits.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        backward_fn(
            g1[rows],
            g2[rows],
            logits[rows],
            targets[rows],
            softmax_stats[rows],
            vocab_start,
            vocab_size,
            inv_t,
            grad[rows],
        )
    return grad


def _fake_outputs(rows_like: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    n = rows_like.shape[0]
    out_dtype = reference.compute_dtype(dtype)
    return (
        rows_like.new_empty(n, dtype=out_dtype),
        rows_like.new_empty(n, dtype=out_dtype),
        rows_like.new_empty((n, 2), dtype=out_dtype),
    )


# ---------------------------------------------------------------------------------------------------------
# Op on a logits shard.


@torch.library.custom_op("mcore_rl::vocab_parallel_logprob_entropy", mutates_args=())
def _logprob_entropy_op(
    logits: Tensor,
    targets: Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    chunk_size: int,
    tp_group_name: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    stats = _local_stats(logits, targets, vocab_start, vocab_size, inv_temperature, chunk_size)
    return _finalize(_reduce_over_tp(stats, tp_group_name))


@_logprob_entropy_op.register_fake
def _(logits: Tensor, targets: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_outputs(logits, logits.dtype)


def _logprob_entropy_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    logits, targets, vocab_start, vocab_size, inv_t, chunk_size, _ = inputs
    ctx.save_for_backward(logits, targets, output[2])
    ctx.args = (vocab_start, vocab_size, inv_t, chunk_size)


def _logprob_entropy_backward(
    ctx: Any, grad_logprob: Tensor, grad_entropy: Tensor, _: Tensor
) -> tuple[Any, ...]:
    logits, targets, softmax_stats = ctx.saved_tensors
    grad = _logits_grad(grad_logprob, grad_entropy, logits, targets, softmax_stats, *ctx.args)
    return grad, None, None, None, None, None, None


_logprob_entropy_op.register_autograd(_logprob_entropy_backward, setup_context=_logprob_entropy_setup)


# ---------------------------------------------------------------------------------------------------------
# Op fused with the output projection: logits are produced and consumed one vocab chunk at a time.


def chunks_kept(chunks: list[tuple[int, int]], keep_logits_bytes: int, row_bytes: int) -> int:
    """How many leading vocab ``chunks`` (:func:`vocab_chunks`) the forward keeps within ``keep_logits_bytes``
    when each logits column takes ``row_bytes`` (rows x element size): whole chunks only, from column 0."""
    columns = keep_logits_bytes // max(1, row_bytes)
    return sum(1 for _, stop in chunks if stop <= columns)  # chunks start at 0, back to back


def kept_columns(chunks: list[tuple[int, int]], keep_chunks: int) -> int:
    """The logits columns of the ``keep_chunks`` leading chunks."""
    return sum(stop - start for start, stop in chunks[:keep_chunks])


def vocab_chunks(num_rows: int, vocab_start: int, vocab_size: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of the weight shard to project: its real vocab rows only, megatron's padding
    rows never enter a GEMM (their logits would be dropped, their gradient is zero)."""
    real_rows = reference.valid_columns(vocab_start, vocab_size, num_rows)
    return [(start, min(start + chunk, real_rows)) for start in range(0, real_rows, chunk)]


class _ChunkBuffer:
    """One allocation reused by every vocab chunk's [N, columns] block. A fresh block per chunk costs more
    than its GEMM's memory traffic on CPU: blocks this large (N x 4096 x 4 bytes is 134 MB at 8k tokens)
    come straight from mmap and go back to the system when freed, so every chunk would page-fault its
    whole block in again (measured 20-25% of the chunk's GEMM time on the 2-core CPU machines)."""

    def __init__(self, like: Tensor, chunks: list[tuple[int, int]]) -> None:
        widest = max((stop - start for start, stop in chunks), default=0)
        self.rows = like.shape[0]
        self.flat = like.new_empty(self.rows * widest)

    def block(self, columns: int) -> Tensor:
        return self.flat[: self.rows * columns].view(self.rows, columns)


def _chunk_logits(kept: Tensor, is_kept: bool, buffer: _ChunkBuffer, start: int, stop: int) -> Tensor:
    """Where a chunk's [rows, stop - start] logits live: its own block of ``kept`` (the leading chunks, back to
    back from column 0) or the buffer every other chunk reuses."""
    if is_kept:
        rows = buffer.rows
        return kept[start * rows : stop * rows].view(rows, stop - start)
    return buffer.block(stop - start)


@torch.library.custom_op("mcore_rl::linear_logprob_entropy", mutates_args=())
def _linear_logprob_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    vocab_chunk_size: int,
    tp_group_name: str | None,
    keep_chunks: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    stats = torch.zeros(hidden.shape[0], 4, dtype=reference.compute_dtype(hidden.dtype), device=hidden.device)
    stats[:, 0] = float("-inf")
    chunks = vocab_chunks(weight.shape[0], vocab_start, vocab_size, vocab_chunk_size)
    buffer = _ChunkBuffer(hidden, chunks[keep_chunks:])
    kept = hidden.new_empty(hidden.shape[0] * kept_columns(chunks, keep_chunks))
    for index, (start, stop) in enumerate(chunks):
        logits = _chunk_logits(kept, index < keep_chunks, buffer, start, stop)
        gemm_into(logits, hidden, weight[start:stop].T, accumulate=False)
        chunk_stats = _stats_fn(logits)(logits, targets, vocab_start + start, vocab_size, inv_temperature)
        stats = _merge(stats, chunk_stats)
    return (*_finalize(_reduce_over_tp(stats, tp_group_name)), kept)


@_linear_logprob_entropy_op.register_fake
def _(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    vocab_chunk_size: int,
    tp_group_name: str | None,
    keep_chunks: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    chunks = vocab_chunks(weight.shape[0], vocab_start, vocab_size, vocab_chunk_size)
    kept = hidden.new_empty(hidden.shape[0] * kept_columns(chunks, keep_chunks))
    return (*_fake_outputs(hidden, hidden.dtype), kept)


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    hidden, weight, targets, vocab_start, vocab_size, inv_t, vocab_chunk_size, _, keep_chunks = inputs
    ctx.save_for_backward(hidden, weight, targets, output[2], output[3])
    ctx.args = (vocab_start, vocab_size, inv_t, vocab_chunk_size, keep_chunks)
    # Outputs without a gradient come to the backward as None, not zeros: the kept logits' would be a second
    # block of their size (up to model.keep_logits_gib) zeroed at every backward; an unused entropy's a row.
    ctx.set_materialize_grads(False)


def _linear_backward(
    ctx: Any, grad_logprob: Tensor | None, grad_entropy: Tensor | None, *_: Tensor | None
) -> tuple[Any, ...]:
    hidden, weight, targets, softmax_stats, kept = ctx.saved_tensors
    vocab_start, vocab_size, inv_t, chunk, keep_chunks = ctx.args
    # Accumulate dL/dhidden over vocab chunks in fp32; padding rows of the weight get zero gradient.
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    # A frozen head (LoRA without the output layer as a target) gets no [vocab, hidden] gradient: neither
    # its buffer nor its GEMM, a third of the head's backward.
    grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
    chunks = vocab_chunks(weight.shape[0], vocab_start, vocab_size, chunk)
    logits_buffer, grad_buffer = _ChunkBuffer(hidden, chunks[keep_chunks:]), _ChunkBuffer(hidden, chunks)
    # In place where the dtypes allow (fp32): no [N, hidden] or [chunk, hidden] temporary per chunk.
    accumulate = hidden.dtype == torch.float32 and weight.dtype == hidden.dtype
    for index, (start, stop) in enumerate(chunks):
        w = weight[start:stop]
        logits = _chunk_logits(kept, index < keep_chunks, logits_buffer, start, stop)
        if index >= keep_chunks:  # the forward kept only the per-row (lse, entropy)
            gemm_into(logits, hidden, w.T, accumulate=False)
        chunk_start, all_rows = vocab_start + start, hidden.shape[0] or 1
        grad_logits = _logits_grad(
            grad_logprob,
            grad_entropy,
            logits,
            targets,
            softmax_stats,
            chunk_start,
            vocab_size,
            inv_t,
            all_rows,
            out=grad_buffer.block(stop - start),
        )
        if accumulate:
            gemm_into(grad_hidden, grad_logits, w, accumulate=True)
            if grad_weight is not None:
                gemm_into(grad_weight[start:stop], grad_logits.T, hidden, accumulate=False)
        else:
            grad_hidden += grad_logits @ w
            if grad_weight is not None:
                grad_weight[start:stop] = grad_logits.T @ hidden
    return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None


_linear_logprob_entropy_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# ---------------------------------------------------------------------------------------------------------
# Public API.


def _group_name(tp_group: dist.ProcessGroup | None) -> str | None:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None
    return tp_group.group_name


def _check_common(
    targets: Tensor, rows_shape: torch.Size, vocab_start: int, vocab_size: int, temperature: float
) -> Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_start < 0 or vocab_size <= 0:
        raise ValueError(f"need vocab_start >= 0 and vocab_size > 0, got {vocab_start}, {vocab_size}")
    if targets.shape != rows_shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match the rows {tuple(rows_shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64 token ids, got {targets.dtype}")
    return targets.reshape(-1).to(torch.int64).contiguous()


def vocab_parallel_logprob_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """log p(target) and entropy of ``softmax(logits / temperature)`` over the whole (TP-sharded) vocab.

    Args:
        logits_shard: [..., V/tp] this rank's vocab shard (fp32, bf16 or fp16; fp64 runs the reference).
        targets: [...] token ids in ``[0, vocab_size)``; every row counts (nothing is ignored, -100 is an error).
        vocab_start: global id of the shard's first column (``tp_rank * V/tp``).
        vocab_size: the real, unpadded vocab size; columns with global id >= it are excluded.
        temperature: the sampling temperature the rollout used (logits are divided by it).
        tp_group: the tensor-parallel group the vocab is split over; None means the shard is the whole vocab.
        chunk_size: rows per kernel call (bounds the reference path's temporaries).

    Returns:
        (logprob [...], entropy [...]) in fp32 (fp64 for fp64 logits), differentiable w.r.t. logits_shard.
        Every rank of ``tp_group`` gets the same values; all of them must call this with their shard.
    """
    tokens = _check_common(targets, logits_shard.shape[:-1], vocab_start, vocab_size, temperature)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    logits = logits_shard.reshape(-1, logits_shard.shape[-1])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    logprob, entropy, _ = _logprob_entropy_op(
        logits, tokens, vocab_start, vocab_size, 1.0 / temperature, chunk_size, _group_name(tp_group)
    )
    return logprob.view(targets.shape), entropy.view(targets.shape)


def linear_logprob_entropy(
    hidden: Tensor,
    weight_shard: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK,
    keep_logits_bytes: int = 0,
) -> tuple[Tensor, Tensor]:
    """Same as :func:`vocab_parallel_logprob_entropy` on ``logits = hidden @ weight_shard.T``, without ever
    holding more than ``N x vocab_chunk_size`` logits beyond ``keep_logits_bytes`` (the forward streams vocab
    chunks through the stats kernel; the backward recomputes each chunk's logits, except the leading chunks
    the forward kept within that budget: the same values, bit for bit, without their GEMM).

    Args:
        hidden: [..., H] final hidden states (after the final norm).
        weight_shard: [V/tp, H] this rank's rows of the output layer (lm head).
        keep_logits_bytes: how many bytes of logits the forward may keep for the backward when a gradient
            will be taken (0: recompute every chunk; at least ``N x V/tp x`` the element size: none).
        Others: as for :func:`vocab_parallel_logprob_entropy`.

    Returns:
        (logprob [...], entropy [...]), differentiable w.r.t. hidden and weight_shard.
    """
    tokens = _check_common(targets, hidden.shape[:-1], vocab_start, vocab_size, temperature)
    if vocab_chunk_size <= 0:
        raise ValueError(f"vocab_chunk_size must be > 0, got {vocab_chunk_size}")
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight_shard {tuple(weight_shard.shape)} does not match hidden {tuple(hidden.shape)}"
        )
    if keep_logits_bytes < 0:
        raise ValueError(f"keep_logits_bytes must be >= 0, got {keep_logits_bytes}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad)
    keep = 0
    if differentiable and keep_logits_bytes > 0 and rows.shape[0] > 0:
        chunks = vocab_chunks(weight_shard.shape[0], vocab_start, vocab_size, vocab_chunk_size)
        keep = chunks_kept(chunks, keep_logits_bytes, rows.shape[0] * rows.element_size())
    logprob, entropy, _, _ = _linear_logprob_entropy_op(
        rows,
        weight_shard,
        tokens,
        vocab_start,
        vocab_size,
        1.0 / temperature,
        vocab_chunk_size,
        _group_name(tp_group),
        keep,
    )
    return logprob.view(targets.shape), entropy.view(targets.shape)


if _native.extension_loaded():
    # Fake kernels of the compiled ops, for FakeTensor / torch.compile tracing and torch.library.opcheck.
    @torch.library.register_fake("mcore_rl::logprob_stats")
    def _(
        logits: Tensor, targets: Tensor, vocab_start: int, vocab_size: int, inv_temperature: float
    ) -> Tensor:
        return logits.new_empty((logits.shape[0], 4), dtype=torch.float32)

    @torch.library.register_fake("mcore_rl::logprob_entropy_backward")
    def _(*args: Any) -> None:
        return None
