"""The model side of shared-prompt packing (``engine/packing/shared_prefix.py`` builds the layout): megatron's
``PackedSeqParams`` extended with the per-token positions and the row maps, the attention that reads them, and
the per-token rotary positions.

megatron hands its rotary embedding only ``cu_seqlens_q`` of the packed parameters, not the parameters
themselves, so the per-token positions of a shared-prompt micro-batch travel on that tensor: written by
:func:`attach_token_positions` and read by :func:`token_positions` (``cpu_layers.apply_rotary_pos_emb``), the
only two places that know of it. Plain packed rows carry none and rotate as megatron does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.ops.row_attention import row_attention as ops_row_attention

_POSITIONS = "_mcore_rl_token_positions"


def attach_token_positions(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> None:
    """Let the rotary embedding rotate each packed token by ``positions`` [T] (its position in its rows)."""
    setattr(cu_seqlens, _POSITIONS, positions)


def token_positions(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """The per-token positions :func:`attach_token_positions` put on ``cu_seqlens``; None for plain packing."""
    return getattr(cu_seqlens, _POSITIONS, None)


@functools.cache
def seq_params_class() -> type:
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class SharedPrefixSeqParams(PackedSeqParams):
        """``thd`` packing whose segments may hold a shared prompt and several responses (module
        docstring): ``positions`` [T] each token's position in its rows, ``row_source`` [b * s] the packed
        token at each row position (0 past a row's end), ``token_home`` [T] the row position each token's
        output is read from (0 for filler), ``rows`` (b, s)."""

        positions: torch.Tensor | None = None
        row_source: torch.Tensor | None = None
        token_home: torch.Tensor | None = None
        rows: tuple[int, int] = (0, 0)

    return SharedPrefixSeqParams


def row_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: Any, scale: float
) -> torch.Tensor:
    """Causal attention of packed ``query`` [T, heads, d], ``key`` / ``value`` [T, groups, d] in row layout
    (module docstring) -> [T, heads * d], by :func:`mcore_rl.ops.row_attention.row_attention`.

    Row positions past a row's end read token 0 (``row_source``), and filler tokens (in no row) have
    position 0 as their home (``token_home``): causality keeps every real query of a row from seeing the
    former, and no token reads the outputs of the latter."""
    return ops_row_attention(
        query,
        key,
        value,
        packed.row_source,
        packed.token_home,
        packed.cu_seqlens_q,
        packed.rows,
        scale,
    )
