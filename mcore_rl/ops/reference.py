"""Pure-PyTorch references of the mcore_rl ops: the fallback when the extension is not built, and the oracle
the tests hold the kernels to.

Each function here computes exactly what the compiled op of the same name computes (same schema, same
outputs), in fp32 for fp32/bf16/fp16 inputs and in fp64 for fp64 inputs, so running it on fp64 inputs gives the
high-precision oracle. ``naive_logprob_entropy`` is the textbook path the kernels replace (and the baseline of
bench/bench_logprob.py). The torch.cat-based layout functions at the end are the oracle of the pack tables
built in :mod:`mcore_rl.ops.pack` and the baseline of bench/bench_pack.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

TABLE_COLUMNS = 7  # see mcore_rl.ops.pack for the meaning of each column
PANEL_COLUMNS = 16  # output columns per panel of a packed decode_linear weight


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the ops compute in: fp64 stays fp64, everything else runs in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def valid_columns(vocab_start: int, vocab_size: int, num_columns: int) -> int:
    """How many leading columns of a shard hold real tokens; the rest is megatron's vocab padding."""
    return max(0, min(vocab_size - vocab_start, num_columns))


def check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    if targets.numel() and bool(((targets < 0) | (targets >= vocab_size)).any()):
        bad = targets[(targets < 0) | (targets >= vocab_size)][0].item()
        raise ValueError(
            f"target id {bad} is outside [0, vocab_size={vocab_size}); targets must be real token ids"
        )


def _target_column(
    targets: torch.Tensor, vocab_start: int, num_valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each row's target in this shard, clamped into range; whether this shard holds it)."""
    local = targets - vocab_start
    held = (local >= 0) & (local < num_valid)
    return local.clamp(0, max(num_valid - 1, 0)), held


def logprob_stats(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, inv_temperature: float
) -> torch.Tensor:
    """Per-row softmax statistics of one vocab shard, [N, 4]: (max z, sum e^(z-max), sum e^(z-max)(z-max),
    target z or 0), z = logits * inv_temperature over the columns with global id < vocab_size."""
    check_targets(targets, vocab_size)
    num_valid = valid_columns(vocab_start, vocab_size, logits.shape[1])
    dtype = compute_dtype(logits.dtype)
    stats = torch.zeros(logits.shape[0], 4, dtype=dtype, device=logits.device)
    stats[:, 0] = float("-inf")
    if num_valid == 0:
        return stats
    z = logits[:, :num_valid].to(dtype) * inv_temperature
    row_max = z.amax(dim=1)
    d = z - torch.where(row_max == float("-inf"), 0.0, row_max)[:, None]  # rows of only -inf stay -inf
    e = torch.exp(d)
    column, held = _target_column(targets, vocab_start, num_valid)
    stats[:, 0] = row_max
    stats[:, 1] = e.sum(dim=1)
    stats[:, 2] = torch.where(e > 0, e * d, 0.0).sum(dim=1)  # e = 0 where z = -inf: 0, not 0 * -inf
    stats[:, 3] = torch.where(held, z.gather(1, column[:, None])[:, 0], 0.0)
    return stats


def logprob_entropy_backward(
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    softmax_stats: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    inv_temperature: float,
    grad_logits: torch.Tensor,
) -> None:
    """Writes d(g1 . logprob + g2 . entropy)/d logits into grad_logits, from softmax_stats [N, 2] = (lse, H).

    Targets were validated by the forward; not checking them again keeps this traceable (no data-dependent
    branch) when autograd is compiled."""
    num_valid = valid_columns(vocab_start, vocab_size, logits.shape[1])
    grad_logits[:, num_valid:] = 0  # padding columns never entered the softmax
    if num_valid == 0:
        return
    dtype = compute_dtype(logits.dtype)
    z = logits[:, :num_valid].to(dtype) * inv_temperature
    lse, entropy = softmax_stats.to(dtype).unbind(dim=1)
    g1, g2 = grad_logprob.to(dtype)[:, None], grad_entropy.to(dtype)[:, None]
    log_p = z - lse[:, None]
    p = torch.exp(log_p)
    dz = torch.where(p > 0, -p * (g1 + g2 * (log_p + entropy[:, None])), 0.0)
    column, held = _target_column(targets, vocab_start, num_valid)
    dz.scatter_add_(1, column[:, None], torch.where(held[:, None], g1, 0.0))
    grad_logits[:, :num_valid] = dz * inv_temperature


def naive_logprob_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path on full (not sharded) logits [..., V]: log_softmax + gather, and verl's
    ``entropy = logsumexp(z) - sum softmax(z) * z``. Materialises several [N, V] tensors."""
    z = logits[..., :vocab_size].to(compute_dtype(logits.dtype)) / temperature
    logprob = torch.gather(F.log_softmax(z, dim=-1), -1, targets[..., None].long())[..., 0]
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logprob, entropy


# ---------------------------------------------------------------------------------------------------------
# Pack / unpack: the copy table interpreted block by block with strided views.


def _block(flat: torch.Tensor, offset: int, rows: int, cols: int, stride: int, what: str) -> torch.Tensor:
    if min(offset, rows, cols, stride) < 0:
        raise ValueError(f"{what}: negative entry in copy table")
    if rows and cols and offset + (rows - 1) * stride + cols > flat.numel():
        raise ValueError(f"{what}: block reaches past the end of its tensor ({flat.numel()} elements)")
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


def _flat(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError(f"every {what} tensor must be contiguous")
    return [t.view(-1) for t in tensors]


def _check_table(table: torch.Tensor) -> list[list[int]]:
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(f"table must be int64 [K, {TABLE_COLUMNS}], got {table.dtype} {tuple(table.shape)}")
    return table.tolist()


def pack_copy(sources: Sequence[torch.Tensor], table: torch.Tensor, out: torch.Tensor) -> None:
    """Copies every block of ``table`` from ``sources`` into the flat ``out``, casting to ``out.dtype``."""
    flat_sources, (flat_out,) = _flat(sources, "source"), _flat([out], "output")
    for src, src_off, rows, cols, src_stride, dst_off, dst_stride in _check_table(table):
        dst = _block(flat_out, dst_off, rows, cols, dst_stride, "output")
        dst.copy_(_block(flat_sources[src], src_off, rows, cols, src_stride, f"source {src}"))


def unpack_copy(packed: torch.Tensor, table: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """The inverse of pack_copy with the same table: blocks of ``packed`` back into ``outs``."""
    (flat_packed,), flat_outs = _flat([packed], "packed"), _flat(outs, "output")
    for dst, dst_off, rows, cols, dst_stride, src_off, src_stride in _check_table(table):
        block = _block(flat_outs[dst], dst_off, rows, cols, dst_stride, f"output {dst}")
        block.copy_(_block(flat_packed, src_off, rows, cols, src_stride, "packed"))


# ---------------------------------------------------------------------------------------------------------
# Rollout layouts by slicing and torch.cat, the way verl's default_tp_concat_fn gathers megatron shards
# followed by vLLM's weight loader narrowing the full tensor to its TP rank.


def kv_heads_of_rank(num_query_groups: int, dst_tp: int, dst_rank: int) -> slice:
    """The KV heads a vLLM QKVParallelLinear rank holds: a block of them, or one replicated head."""
    if num_query_groups >= dst_tp:
        per_rank = num_query_groups // dst_tp
        return slice(dst_rank * per_rank, (dst_rank + 1) * per_rank)
    head = dst_rank // (dst_tp // num_query_groups)
    return slice(head, head + 1)


def qkv_to_rollout(
    shards: Sequence[torch.Tensor],
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
    dst_tp: int,
    dst_rank: int,
) -> torch.Tensor:
    """megatron linear_qkv TP shards (per query group: its q heads, then k, then v) -> the [q; k; v] rows of
    rollout rank ``dst_rank`` of ``dst_tp``."""
    heads_per_group = num_heads // num_query_groups
    qs, ks, vs = [], [], []
    for shard in shards:
        grouped = shard.reshape(-1, heads_per_group + 2, head_dim, *shard.shape[1:])
        q, k, v = grouped.split([heads_per_group, 1, 1], dim=1)
        qs.append(q.reshape(-1, *shard.shape[1:]))
        ks.append(k.reshape(-1, *shard.shape[1:]))
        vs.append(v.reshape(-1, *shard.shape[1:]))
    q_all, k_all, v_all = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    q_rows = num_heads // dst_tp * head_dim
    kv = kv_heads_of_rank(num_query_groups, dst_tp, dst_rank)
    kv_rows = slice(kv.start * head_dim, kv.stop * head_dim)
    return torch.cat([q_all[dst_rank * q_rows : (dst_rank + 1) * q_rows], k_all[kv_rows], v_all[kv_rows]])


def gated_fc1_to_rollout(shards: Sequence[torch.Tensor], *, dst_tp: int, dst_rank: int) -> torch.Tensor:
    """megatron linear_fc1 shards ([gate_r; up_r] each) -> [gate; up] rows of rollout rank ``dst_rank``."""
    gates, ups = zip(*(shard.chunk(2) for shard in shards), strict=True)
    gate, up = torch.cat(gates), torch.cat(ups)
    return torch.cat([gate.chunk(dst_tp)[dst_rank], up.chunk(dst_tp)[dst_rank]])


def column_parallel_to_rollout(shards: Sequence[torch.Tensor], *, dst_tp: int, dst_rank: int) -> torch.Tensor:
    """Tensors split along dim 0 (column-parallel linears, embeddings) -> rows of rollout rank ``dst_rank``."""
    return torch.cat(list(shards)).chunk(dst_tp)[dst_rank]


def row_parallel_to_rollout(shards: Sequence[torch.Tensor], *, dst_tp: int, dst_rank: int) -> torch.Tensor:
    """Weights split along dim 1 (row-parallel linears) -> columns of rollout rank ``dst_rank``."""
    return torch.cat(list(shards), dim=1).chunk(dst_tp, dim=1)[dst_rank]


def rotate_signed_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved rotary on the first ``cos.shape[-1]`` dims of ``x`` (the rest passes through).

    ``sin`` is signed (``[-sin, +sin]`` halves), so ``rotate_half(x) * sin`` is ``swap_halves(x) * sin``.
    """
    rot = cos.shape[-1]
    half = rot // 2
    head = x[..., :rot]
    rotated = head * cos + torch.cat([head[..., half:], head[..., :half]], dim=-1) * sin
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    column: int,
    start: torch.Tensor | None,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """One decode step of grouped-query attention with a KV cache (see :mod:`mcore_rl.ops.decode`)."""
    b, num_kv, head_dim = qkv.shape[0], keys.shape[1], keys.shape[2]
    dtype = compute_dtype(qkv.dtype)
    q, k, v = qkv.to(dtype).view(b, num_heads + 2 * num_kv, head_dim).split([num_heads, num_kv, num_kv], 1)
    cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [b or 1, 1, rotary_dim]
    q, k = rotate_signed_halves(q, cos, sin), rotate_signed_halves(k, cos, sin)
    keys[:b, :, :, column] = k.to(keys.dtype)
    values[:b, :, column] = v.to(values.dtype)
    cached_keys = keys[:b, :, :, : column + 1].to(dtype)  # [b, kv, head_dim, L]
    cached_values = values[:b, :, : column + 1].to(dtype)  # [b, kv, L, head_dim]
    scores = torch.matmul(q.reshape(b, num_kv, num_heads // num_kv, head_dim), cached_keys) * scale
    if start is not None:
        hidden = torch.arange(column + 1, device=qkv.device) < start[:, None]  # [b, L]
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    context = torch.matmul(torch.softmax(scores, dim=-1), cached_values)  # [b, kv, group, head_dim]
    return context.reshape(b, num_heads * head_dim).to(qkv.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x * x, -1) + eps) * weight`` (``torch.nn.RMSNorm``) in the compute dtype.

    Spelled as ``F.rms_norm`` computes it (``x * x`` is its ``pow(x, 2)``, the mean is sum / n), so in fp32 it
    is bitwise equal to megatron's norm while skipping the composite's dtype round trips; in-place ops avoid
    scalar-to-tensor copies."""
    dtype = compute_dtype(x.dtype)
    xc = x.to(dtype)
    inv_rms = (xc * xc).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
    return (xc * inv_rms * weight.to(dtype)).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[rows, 2f] = [gate | up]``."""
    gate, up = gate_up.to(compute_dtype(gate_up.dtype)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def pack_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> column panels [ceil(N / 16), K, 16], zero-padded past column N (see mcore_rl.ops.decode)."""
    k, n = weight_t.shape
    padded = torch.zeros(
        k, -(-n // PANEL_COLUMNS) * PANEL_COLUMNS, dtype=weight_t.dtype, device=weight_t.device
    )
    padded[:, :n] = weight_t
    return padded.view(k, -1, PANEL_COLUMNS).transpose(0, 1).contiguous()


def decode_linear(x: torch.Tensor, panels: torch.Tensor, n: int, add: torch.Tensor | None) -> torch.Tensor:
    """``add + x @ W`` with ``W`` [K, n] given as column panels (``add`` None, [n] or [M, n])."""
    dtype = compute_dtype(x.dtype)
    weight_t = panels.to(dtype).transpose(0, 1).reshape(panels.shape[1], -1)[:, :n]
    out = x.to(dtype) @ weight_t
    return (out if add is None else out + add.to(dtype)).to(x.dtype)
