"""Reshard pack: gather TP-sharded training weights into one flat bucket in the rollout engine's layout.

The naive path (verl's ``default_tp_concat_fn`` followed by vLLM's weight loader) concatenates the megatron
shards into full tensors, de-interleaves the fused QKV and gate/up halves with more ``torch.cat`` calls, then
narrows to the rollout rank and casts while copying into the bucket: three or four full copies per weight.
Here a pure-Python :class:`PackPlan` turns the layouts into a table of 2-D block copies, computed once, and
the ``pack_copy`` kernel runs the whole table in one parallel pass that also casts to the bucket's dtype.
``unpack_copy`` runs the same table backwards (bucket -> shard tensors).

Copy table, int64 [K, 7], every entry in elements:

    (source index, source offset, rows, cols, source row stride, packed offset, packed row stride)

Layouts handled, for any source TP degree ``src_tp`` and destination (rollout) degree ``dst_tp``, smaller or
larger (a rank then takes a slice of one source shard):

* megatron ``linear_qkv`` (per query group: its q heads, then k, then v) -> vLLM ``QKVParallelLinear`` rank
  rows ``[q heads of the rank; k; v]``; with ``dst_tp > num_query_groups`` the KV heads are replicated as
  vLLM does (rank r holds KV head ``r // (dst_tp // num_query_groups)``);
* megatron gated ``linear_fc1`` (each rank ``[gate_r; up_r]``) -> ``[gate; up]`` rows of the rollout rank;
* column-parallel (split along dim 0), row-parallel (split along dim 1) and replicated tensors.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.ops import _native, reference

Range = tuple[int, int]
"""[start, stop) rows of a tensor's logical (unsharded) layout."""


def pack_copy(sources: Sequence[Tensor], table: Tensor, out: Tensor) -> None:
    """Runs the block copies of ``table`` from ``sources`` (contiguous, one dtype) into contiguous ``out``,
    casting to ``out.dtype``."""
    if _native.use_native(out.device, out.dtype, *(s.dtype for s in sources)):
        torch.ops.mcore_rl.pack_copy(list(sources), table, out)
    else:
        reference.pack_copy(sources, table, out)


def unpack_copy(packed: Tensor, table: Tensor, outs: Sequence[Tensor]) -> None:
    """The inverse of :func:`pack_copy` with the same table: blocks of ``packed`` back into ``outs``."""
    if _native.use_native(packed.device, packed.dtype, *(t.dtype for t in outs)):
        torch.ops.mcore_rl.unpack_copy(packed, table, list(outs))
    else:
        reference.unpack_copy(packed, table, outs)


if _native.extension_loaded():

    @torch.library.register_fake("mcore_rl::pack_copy")
    def _(sources: list[Tensor], table: Tensor, out: Tensor) -> None:
        return None

    @torch.library.register_fake("mcore_rl::unpack_copy")
    def _(packed: Tensor, table: Tensor, outs: list[Tensor]) -> None:
        return None


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by {parts}")
    return total // parts


def _dim0_blocks(
    shard_rows: Sequence[Sequence[Range]], wanted: Sequence[Range], row_numel: int
) -> list[list[int]]:
    """Blocks copying the logical rows ``wanted`` (in order) out of shards where shard i holds the logical
    rows ``shard_rows[i]``, concatenated. Rows are contiguous runs, so each block is a single row."""
    pieces = sorted(  # (logical start, logical stop, shard, local row of the start)
        (start, stop, shard, local)
        for shard, ranges in enumerate(shard_rows)
        for (start, stop), local in zip(ranges, _running_starts(ranges), strict=True)
    )
    starts = [p[0] for p in pieces]
    blocks: list[list[int]] = []
    dst = 0
    for start, stop in wanted:
        pos = start
        while pos < stop:
            p_start, p_stop, shard, local = pieces[bisect.bisect_right(starts, pos) - 1]
            if not p_start <= pos < p_stop:
                raise ValueError(f"no source shard holds logical row {pos}")
            n = (min(stop, p_stop) - pos) * row_numel
            blocks.append([shard, (local + pos - p_start) * row_numel, 1, n, n, dst, n])
            pos, dst = pos + n // row_numel, dst + n
    return _merge_runs(blocks)


def _running_starts(ranges: Sequence[Range]) -> list[int]:
    out, acc = [], 0
    for start, stop in ranges:
        out.append(acc)
        acc += stop - start
    return out


def _merge_runs(blocks: list[list[int]]) -> list[list[int]]:
    """Joins single-row blocks that continue each other on both sides into one longer run."""
    merged: list[list[int]] = []
    for b in blocks:
        last = merged[-1] if merged else None
        if last and last[0] == b[0] and last[1] + last[3] == b[1] and last[5] + last[3] == b[5]:
            last[3] += b[3]
            last[4] = last[6] = last[3]
        else:
            merged.append(list(b))
    return merged


@dataclass(frozen=True)
class PackedTensor:
    """Where one weight sits in the bucket and which ``sources`` entries it is gathered from."""

    name: str
    offset: int
    """Elements from the start of the bucket."""
    shape: tuple[int, ...]
    """Shape of this rollout rank's tensor (``PackPlan.views`` returns it so)."""
    first_source: int
    """Index of its first shard in the ``sources`` list given to ``PackPlan.pack``."""
    source_shape: tuple[int, ...]
    """Shape of each of its source shards."""
    num_sources: int


class PackPlan:
    """Block copies that gather TP-sharded tensors into one flat bucket for rollout rank ``dst_rank`` of
    ``dst_tp``. Add tensors in order; ``pack`` then takes their shards in the same order (all ``src_tp`` shards
    of each sharded tensor, one tensor for a replicated one). The plan is pure data: build it once, reuse it
    every weight sync."""

    def __init__(self, *, src_tp: int, dst_tp: int, dst_rank: int) -> None:
        if src_tp < 1 or dst_tp < 1 or not 0 <= dst_rank < dst_tp:
            raise ValueError(f"bad TP degrees: src_tp={src_tp}, dst_tp={dst_tp}, dst_rank={dst_rank}")
        self.src_tp, self.dst_tp, self.dst_rank = src_tp, dst_tp, dst_rank
        self.entries: list[PackedTensor] = []
        self.numel = 0
        self.num_sources = 0
        self._rows: list[list[int]] = []

    def _add(
        self,
        name: str,
        shape: tuple[int, ...],
        source_shape: tuple[int, ...],
        num_sources: int,
        blocks: list[list[int]],
    ) -> PackedTensor:
        entry = PackedTensor(name, self.numel, shape, self.num_sources, source_shape, num_sources)
        for b in blocks:
            self._rows.append([b[0] + self.num_sources, b[1], b[2], b[3], b[4], b[5] + self.numel, b[6]])
        self.entries.append(entry)
        self.numel += _numel(shape)
        self.num_sources += num_sources
        return entry

    def _dim0(
        self, name: str, rows: int, columns: int | None, shard_rows: list[list[Range]], wanted: list[Range]
    ) -> PackedTensor:
        tail = () if columns is None else (columns,)
        source_shape = (sum(b - a for a, b in shard_rows[0]), *tail)
        shape = (sum(b - a for a, b in wanted), *tail)
        return self._add(
            name, shape, source_shape, self.src_tp, _dim0_blocks(shard_rows, wanted, columns or 1)
        )

    def add_qkv(
        self, name: str, *, num_heads: int, num_query_groups: int, head_dim: int, columns: int | None
    ) -> PackedTensor:
        """megatron ``linear_qkv`` weight (``columns`` = hidden size) or bias (``columns=None``)."""
        heads_per_group = _split(num_heads, num_query_groups, "num_heads")
        group_rows = (heads_per_group + 2) * head_dim
        local_groups = _split(num_query_groups, self.src_tp, "num_query_groups")
        shard_rows = [
            [(r * local_groups * group_rows, (r + 1) * local_groups * group_rows)] for r in range(self.src_tp)
        ]
        q_heads = _split(num_heads, self.dst_tp, "num_heads")
        if num_query_groups < self.dst_tp:
            _split(self.dst_tp, num_query_groups, "dst_tp")
        wanted = []
        for head in range(self.dst_rank * q_heads, (self.dst_rank + 1) * q_heads):
            start = head // heads_per_group * group_rows + head % heads_per_group * head_dim
            wanted.append((start, start + head_dim))
        kv = reference.kv_heads_of_rank(num_query_groups, self.dst_tp, self.dst_rank)
        for offset in (heads_per_group * head_dim, (heads_per_group + 1) * head_dim):  # k, then v
            wanted += [
                (g * group_rows + offset, g * group_rows + offset + head_dim)
                for g in range(kv.start, kv.stop)
            ]
        return self._dim0(name, num_query_groups * group_rows, columns, shard_rows, wanted)

    def add_gated_fc1(self, name: str, *, ffn_hidden_size: int, columns: int | None) -> PackedTensor:
        """megatron gated ``linear_fc1`` (SwiGLU gate and up projections fused, each rank ``[gate_r; up_r]``)."""
        src = _split(ffn_hidden_size, self.src_tp, "ffn_hidden_size")
        dst = _split(ffn_hidden_size, self.dst_tp, "ffn_hidden_size")
        shard_rows = [
            [(r * src, (r + 1) * src), (ffn_hidden_size + r * src, ffn_hidden_size + (r + 1) * src)]
            for r in range(self.src_tp)
        ]
        r = self.dst_rank
        wanted = [(r * dst, (r + 1) * dst), (ffn_hidden_size + r * dst, ffn_hidden_size + (r + 1) * dst)]
        return self._dim0(name, 2 * ffn_hidden_size, columns, shard_rows, wanted)

    def add_column_parallel(self, name: str, *, rows: int, columns: int | None) -> PackedTensor:
        """A tensor split along dim 0 (column-parallel linear weight or bias, vocab-parallel embedding)."""
        src, dst = _split(rows, self.src_tp, "rows"), _split(rows, self.dst_tp, "rows")
        shard_rows = [[(r * src, (r + 1) * src)] for r in range(self.src_tp)]
        return self._dim0(name, rows, columns, shard_rows, [(self.dst_rank * dst, (self.dst_rank + 1) * dst)])

    def add_row_parallel(self, name: str, *, rows: int, columns: int) -> PackedTensor:
        """A weight split along dim 1 (row-parallel linear: attention output, fc2)."""
        src, dst = _split(columns, self.src_tp, "columns"), _split(columns, self.dst_tp, "columns")
        lo, hi = self.dst_rank * dst, (self.dst_rank + 1) * dst
        blocks = []
        for shard in range(lo // src, (hi - 1) // src + 1):  # source shards overlapping [lo, hi)
            a, b = max(lo, shard * src), min(hi, (shard + 1) * src)
            blocks.append([shard, a - shard * src, rows, b - a, src, a - lo, dst])
        return self._add(name, (rows, dst), (rows, src), self.src_tp, blocks)

    def add_replicated(self, name: str, *, shape: tuple[int, ...]) -> PackedTensor:
        """A tensor every rank holds whole (norm weights); packed from a single source."""
        n = _numel(shape)
        return self._add(name, shape, shape, 1, [[0, 0, 1, n, n, 0, n]] if n else [])

    def table(self) -> Tensor:
        """The copy table, int64 [K, 7] (see the module docstring)."""
        return torch.tensor(self._rows, dtype=torch.int64).reshape(-1, reference.TABLE_COLUMNS)

    def check_sources(self, sources: Sequence[Tensor]) -> None:
        if len(sources) != self.num_sources:
            raise ValueError(f"plan needs {self.num_sources} source tensors, got {len(sources)}")
        for entry in self.entries:
            for i in range(entry.first_source, entry.first_source + entry.num_sources):
                if tuple(sources[i].shape) != entry.source_shape:
                    raise ValueError(
                        f"{entry.name}: source {i} has shape {tuple(sources[i].shape)}, expected {entry.source_shape}"
                    )

    def pack(self, sources: Sequence[Tensor], out: Tensor, table: Tensor | None = None) -> Tensor:
        """Packs ``sources`` into ``out`` (a flat bucket of at least ``numel`` elements) and returns it.
        Pass the precomputed ``table()`` to skip rebuilding it on every call."""
        self.check_sources(sources)
        pack_copy(sources, self.table() if table is None else table, out)
        return out

    def unpack(self, packed: Tensor, outs: Sequence[Tensor], table: Tensor | None = None) -> None:
        """Copies the bucket back into the shard tensors ``outs`` (only the parts this rank holds)."""
        self.check_sources(outs)
        unpack_copy(packed, self.table() if table is None else table, outs)

    def views(self, packed: Tensor) -> dict[str, Tensor]:
        """Each packed tensor as a view of the bucket, in this rollout rank's shape."""
        return {e.name: packed[e.offset : e.offset + _numel(e.shape)].view(e.shape) for e in self.entries}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
