"""The rollout decoder's rotary tables: megatron's fp32 ``cos`` / ``sin`` of ``position * inv_freq``, grown on
demand and read at each row's position (sequences are left-padded in the KV cache, so a row's position is its
cache column less its padding)."""

from __future__ import annotations

import torch
from torch import Tensor

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rope import rope_inv_freq


class RotaryTables:
    """cos and signed sin, [length, rotary_dim], fp32 as megatron computes them.

    megatron's ``rotate_half(x) * sin`` is ``[-x2, x1] * sin``; we compute ``[x2, x1] * [-sin1, sin2]`` (no
    negation of activations, ``ops.reference.rotate_signed_halves``), bitwise the same product.
    """

    def __init__(self, arch: ModelArch, device: torch.device) -> None:
        self.device = device
        self._inv_freq = rope_inv_freq(arch).to(device)
        self._cos = self._sin = torch.empty(0, arch.rotary_dim, device=device)

    def tables(self, length: int) -> tuple[Tensor, Tensor]:
        """The tables for positions [0, length) at least (grown by doubling)."""
        if self._cos.shape[0] < length:
            length = max(length, 2 * self._cos.shape[0])
            positions = torch.arange(length, device=self.device, dtype=torch.float32)
            freqs = torch.outer(positions, self._inv_freq)
            freqs = torch.cat([freqs, freqs], dim=-1)
            half = freqs.shape[-1] // 2
            sign = torch.ones(freqs.shape[-1], device=self.device)
            sign[:half] = -1.0
            self._cos, self._sin = torch.cos(freqs), torch.sin(freqs) * sign
        return self._cos, self._sin

    def at_decode(self, b: int, column: int, pad: Tensor | None) -> tuple[Tensor, Tensor]:
        """A decode step's cos and signed sin [b or 1, rotary_dim] at each row's position ``column - pad``."""
        cos_table, sin_table = self.tables(column + 1)
        if pad is None:  # every row at position == column: one row of the tables, shared by the batch
            return cos_table.narrow(0, column, 1), sin_table.narrow(0, column, 1)
        positions = (column - pad).clamp_min_(0)
        return cos_table[positions], sin_table[positions]

    def at_forward(
        self, s: int, column: int, pad: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """A multi-token forward's (cache columns [column, column + s)) cos and signed sin, [b or 1, s, 1,
        rotary_dim] ([s, 1, rotary_dim] when no row is padded) in ``dtype``."""
        cos_table, sin_table = self.tables(column + s)
        if pad is None:  # every row at position == column: a slice of the tables, shared by the batch
            cos, sin = cos_table[column : column + s, None], sin_table[column : column + s, None]
        else:
            positions = (torch.arange(column, column + s, device=self.device) - pad[:, None]).clamp_min_(0)
            cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin
