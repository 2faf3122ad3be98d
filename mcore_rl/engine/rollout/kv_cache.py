"""The rollout engine's KV cache: its layout, allocation and the row moves of a generation (n samples share a
prefill; finished rows leave the batch). The decoder (``decoder.py``) reads and writes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Per-layer keys ``[rows, kv_heads / tp, head_dim, max_len]`` and values ``[rows, kv_heads / tp, max_len,
    head_dim]``; row r is one sequence, column c one token slot.

    Keys are stored transposed so that ``q @ K`` reads them as a plain (not transposed) gemm operand, which
    halves the decode-step score matmul on CPU. Buffers are zero-initialised so that never-written slots
    are finite (a masked score gets probability 0, but 0 * NaN would still poison the context).

    A cache may be larger than a forward needs (more rows, more columns): forwards address rows from 0 and
    columns by index, and only read columns they or an earlier forward of the same generation wrote, so a
    cache can be reused across waves and calls without clearing it.
    """

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        def zeros(*shape: int) -> list[Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        return cls(zeros(rows, kv_heads, head_dim, max_len), zeros(rows, kv_heads, max_len, head_dim))

    @property
    def max_len(self) -> int:
        return self.values[0].shape[2]

    @property
    def rows(self) -> int:
        return self.values[0].shape[0]

    def _used(self, used_len: int) -> list[Tensor]:
        """Views of every buffer restricted to columns [0, used_len)."""
        return [k[..., :used_len] for k in self.keys] + [v[:, :, :used_len] for v in self.values]

    def repeat_rows(self, num_rows: int, repeats: int, used_len: int) -> None:
        """Rows ``[0, num_rows)`` become rows ``[0, num_rows * repeats)``, each repeated in place (n samples)."""
        for buf in self._used(used_len):
            buf[: num_rows * repeats] = buf[:num_rows].repeat_interleave(repeats, dim=0)

    def keep_rows(self, rows: Tensor, used_len: int) -> None:
        """Compact: rows listed in ``rows`` (ascending) move to the front, in order; the rest is dropped."""
        for buf in self._used(used_len):
            buf[: rows.shape[0]] = buf[rows]
