"""Shared-prompt packing: the rows of a micro-batch that share a prompt (GRPO's n samples of one prompt, or
PPO's) are computed with that prompt once (``model.share_prompt_prefix``).

A group of rows with the same prompt becomes one packed segment::

    [prompt p tokens][response of row 1][response of row 2]...      positions 0..p-1, p.., p.., ...

Every linear layer, norm and MLP then runs on ``(n - 1) * p`` fewer tokens per group of n rows. Attention is
the one operation that mixes tokens: it runs in row layout, each row's keys and values read from the packed
tokens (``source``: a shared prompt token feeds every row of its group), causal within the row exactly as on
the padded path, and each packed token takes its output from one row that holds it (``home``); on CPU in fp32
a fused kernel computes only those home queries (``ops/row_attention.py``). So every token sees what it sees in its own padded row, and the model computes the same
function on fewer tokens; autograd sums a shared token's gradients over its rows. The loss reads [b, s]
rows too: the engine gathers them from the packed output (``PackedInput.source``).

A row's prompt is what comes before its first response position (``response_mask``: position j marks the
prediction of token j + 1); rows group when those tokens are equal. Rows without a response token are
segments of their own.

The model reads the layout from :class:`SharedPrefixSeqParams` (megatron's ``PackedSeqParams`` plus the
per-token positions and the two maps): the local layer spec's attention (``compat.cpu_layers``) calls
:func:`row_attention` and the rotary embedding rotates by the per-token positions. Transformer Engine's
layers know nothing of it, so the option is for the local spec (the CPU) only; the engine refuses it
elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.compat.shared_prefix_attention import attach_token_positions, seq_params_class
from mcore_rl.engine.packing.token_batching import row_lengths
from mcore_rl.engine.train_engine import PackedInput


def shared_prefix_seq_params(rows: SharedPrefixRows) -> Any:
    """megatron's ``PackedSeqParams`` for ``rows``; the positions also ride on ``cu_seqlens_q``, the one
    tensor megatron hands the rotary embedding (``compat/shared_prefix_attention.py``)."""
    cu = torch.zeros(len(rows.segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(rows.segments, dtype=torch.int32), dim=0)
    attach_token_positions(cu, rows.positions)
    longest = int(rows.positions.max()) + 1 if rows.positions.numel() else 0
    return seq_params_class()(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        positions=rows.positions,
        # row_attention's in-range maps: no slot past the tokens or the rows (see there)
        row_source=torch.where(rows.source < rows.tokens.numel(), rows.source, 0),
        token_home=torch.where(rows.home < rows.shape[0] * rows.shape[1], rows.home, 0),
        rows=rows.shape,
    )


@dataclass(frozen=True)
class SharedPrefixRows:
    """A micro-batch's [b, s] rows packed with each shared prompt once (module docstring)."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    segments: tuple[int, ...]
    source: torch.Tensor  # [b * s] int64: the packed token at each row position, T where none is
    home: torch.Tensor  # [T] int64: the row position each packed token's output is read from, b * s: none
    shape: tuple[int, int]  # (b, s)

    def model_input(self) -> PackedInput:
        index = torch.nonzero(self.source < self.tokens.numel()).squeeze(1)  # row positions with a token
        return PackedInput(
            self.tokens[None], self.positions[None], shared_prefix_seq_params(self), index, source=self.source
        )


def _prompt_lengths(response_mask: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """Per row: the columns before its first response position + 1 (its prompt), or its whole length."""
    first = torch.where(response_mask > 0, torch.arange(response_mask.shape[1]), response_mask.shape[1])
    return torch.minimum(first.min(dim=1).values + 1, lengths).tolist()


def shared_prefix_packing(
    tokens: torch.Tensor, response_mask: torch.Tensor, multiple: int = 1, pad_token_id: int = 0
) -> SharedPrefixRows:
    """Pack ``tokens`` [b, s] with every shared prompt once; each row cut after its last response token
    (``token_batching.row_lengths``); a filler segment of ``pad_token_id`` makes T a ``multiple``."""
    b, s = tokens.shape
    lengths = row_lengths(response_mask).tolist()
    prompts = _prompt_lengths(response_mask, torch.as_tensor(lengths))
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(b):
        key = tuple(tokens[row, : prompts[row]].tolist()) if prompts[row] < lengths[row] else (-1 - row,)
        groups.setdefault(key, []).append(row)
    ids, pos, home, segments = [], [], [], []
    source = torch.full((b * s,), -1, dtype=torch.long)
    offset = 0
    for rows in groups.values():
        shared = prompts[rows[0]] if len(rows) > 1 else lengths[rows[0]]  # a lone row is all shared part
        pieces = [(rows[0], 0, shared)] + [(r, shared, lengths[r]) for r in rows if lengths[r] > shared]
        for row, start, end in pieces:
            ids.append(tokens[row, start:end])
            pos.append(torch.arange(start, end))
            home.append(torch.arange(row * s + start, row * s + end))
            readers = rows if start == 0 else [row]  # a shared prompt feeds every row of its group
            for r in readers:
                source[r * s + start : r * s + end] = torch.arange(offset, offset + end - start)
            offset += end - start
        segments.append(sum(end - start for _, start, end in pieces))
    filler = -offset % multiple
    if filler:
        ids.append(torch.full((filler,), pad_token_id, dtype=tokens.dtype))
        pos.append(torch.arange(filler))
        home.append(torch.full((filler,), b * s, dtype=torch.long))
        segments.append(filler)
    source[source < 0] = offset + filler
    return SharedPrefixRows(torch.cat(ids), torch.cat(pos), tuple(segments), source, torch.cat(home), (b, s))
