"""Token-budget batching (verl's ``use_dynamic_bsz`` / ``balance_batch``), pure and tested on CPU.

Rows of a rollout have very different lengths. Three things follow:

- **balance**: each mini-batch's rows are dealt to the data-parallel ranks so that every rank gets the
  same number of rows and about the same number of tokens (:func:`balanced_partitions`, greedy longest-first
  with equal counts); mini-batch membership is kept, so the optimizer steps see the same rows. Without a
  token budget (``trainer.balance_batch``) each prompt's group of samples moves as one;
- **budget**: a rank's mini-batch is cut into micro-batches holding at most ``budget`` tokens each, counted
  as rows x longest row (what the forward computes), instead of a fixed number of rows
  (:func:`budget_micro_batches`);
- **no padding**: each micro-batch is trimmed to its longest row (:func:`trim_columns`). The model is causal,
  so the dropped right-padding columns change no kept position; the losses divide by counts all-reduced
  over the whole mini-batch (``losses.py``), so how rows are grouped changes no loss, gradient or metric.

- **packing** (``model.use_remove_padding``, verl's ``use_remove_padding``): a micro-batch's rows, each cut to
  its length, are laid end to end as one sequence with megatron's ``PackedSeqParams`` (``thd`` layout,
  cumulative lengths; :class:`PackedRows`), so no padding column is computed at all. Attention stays within
  each row and positions restart per row: Transformer Engine's fused attention does that on a GPU, our SDPA
  core attention (``compat/cpu_layers.py``) on a CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mcore_rl.engine.packed_seq import packed_seq_params
from mcore_rl.engine.train_engine import PackedInput

T = TypeVar("T")


def row_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """[N] columns each row needs: up to its last response token (mask position + 1), inclusive."""
    positions = torch.arange(response_mask.shape[1])
    last = torch.where(response_mask > 0, positions, -1).max(dim=1).values
    return (last + 2).clamp(min=1, max=response_mask.shape[1])


def balanced_partitions(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Row indices split into ``num_parts`` parts of equal size with balanced length sums.

    Longest row first, each to the lightest part that still has room (LPT with a cardinality limit): the
    heaviest and lightest parts differ by at most the longest row. Indices inside a part are ascending.
    """
    if num_parts < 1 or len(lengths) % num_parts:
        raise ValueError(f"{len(lengths)} rows do not split into {num_parts} equal parts")
    room = len(lengths) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    sums = [0] * num_parts
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(num_parts) if len(parts[p]) < room), key=lambda p: (sums[p], p))
        parts[part].append(row)
        sums[part] += lengths[row]
    return [sorted(p) for p in parts]


def balanced_order(
    lengths: Sequence[int], num_mini_batches: int, num_ranks: int, group_size: int = 1
) -> list[int]:
    """A row order of the step's batch that keeps every mini-batch's rows and balances them over the ranks.

    The batch is split into ``num_ranks`` contiguous shards and mini-batch k is the k-th of
    ``num_mini_batches`` contiguous slices of every shard (``ActorGroup.update``). In the returned order
    the same split gives mini-batch k the same rows as before, dealt by :func:`balanced_partitions`: row by
    row, or with ``group_size`` > 1 in whole groups of that many consecutive rows (one prompt's samples, which
    shared-prompt packing computes together), each weighing its rows' lengths together.
    """
    num = len(lengths)
    if group_size < 1 or num % (num_mini_batches * num_ranks * group_size):
        raise ValueError(
            f"{num} rows do not split into {num_mini_batches} mini-batches x {num_ranks} ranks"
            + (f" of whole groups of {group_size}" if group_size != 1 else "")
        )
    shard = num // num_ranks
    size = shard // num_mini_batches
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for k in range(num_mini_batches):
        rows = [r * shard + k * size + j for r in range(num_ranks) for j in range(size)]
        groups = [rows[g : g + group_size] for g in range(0, len(rows), group_size)]
        weights = [sum(lengths[i] for i in group) for group in groups]
        for rank, part in enumerate(balanced_partitions(weights, num_ranks)):
            per_rank[rank].extend(row for g in part for row in groups[g])
    return [row for rows in per_rank for row in rows]


def budget_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows grouped so that rows x longest row <= ``budget`` tokens per group (a longer row goes alone).

    Rows are taken longest first, so each group holds rows of similar length (little padding); groups are
    returned in that order with ascending indices inside.
    """
    if budget < 1:
        raise ValueError(f"token budget {budget} must be positive")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        width = max(longest, lengths[row])
        if current and (len(current) + 1) * width > budget:
            groups.append(sorted(current))
            current, longest = [], 0
            width = lengths[row]
        current.append(row)
        longest = width
    if current:
        groups.append(sorted(current))
    return groups


def select_rows(record: T, rows: Sequence[int], width: int | None = None) -> T:
    """The dataclass of [N, ...] tensors restricted to ``rows`` (and to ``width`` columns when given:
    only [N, S] fields are cut, e.g. ``response_ids`` [N, T] are kept)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    seq = record.tokens.shape[1]  # type: ignore[attr-defined]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, field.name)
        if value is None:  # an optional field (e.g. a dense model's expert_choices)
            values[field.name] = None
            continue
        value = value[index]
        if width is not None and value.dim() >= 2 and value.shape[1] == seq:
            value = value[:, :width]
        values[field.name] = value
    return type(record)(**values)


def trim_columns(width: int, multiple: int) -> int:
    """A micro-batch's width: its longest row, rounded up to ``multiple`` (TP with sequence parallelism)."""
    return -(-width // multiple) * multiple


@dataclass(frozen=True)
class PackedRows:
    """How the rows of a [b, s] micro-batch lie end to end in one [1, T] sequence: row i's first
    ``lengths[i]`` columns, then a filler segment when T must be a multiple (sequence parallelism)."""

    lengths: tuple[int, ...]
    """Tokens of each row in the pack."""
    width: int
    """Columns of the unpacked rows."""
    filler: int = 0
    """Tokens appended after the rows (their own segment: they attend among themselves, read by no loss)."""

    @classmethod
    def of(cls, lengths: Sequence[int], width: int, multiple: int = 1) -> PackedRows:
        total = sum(lengths)
        return cls(tuple(int(n) for n in lengths), width, -total % multiple)

    @property
    def segments(self) -> list[int]:
        return [*self.lengths, *([self.filler] if self.filler else [])]

    def _index(self) -> torch.Tensor:
        return torch.cat([torch.arange(n) + i * self.width for i, n in enumerate(self.lengths)])

    def pack(self, rows: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """[b, s] -> [1, T]: the rows' leading ``lengths`` columns end to end, then ``filler`` x ``fill``."""
        flat = rows.reshape(-1)[self._index()]
        if self.filler:
            flat = torch.cat([flat, flat.new_full((self.filler,), fill)])
        return flat[None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, T] -> [b, width]: each row's tokens back in its leading columns, 0 after them."""
        rows = packed.new_zeros(len(self.lengths) * self.width)
        rows[self._index()] = packed[0, : sum(self.lengths)]
        return rows.view(len(self.lengths), self.width)

    def positions(self) -> torch.Tensor:
        """[1, T] position ids restarting at 0 in every segment."""
        return torch.cat([torch.arange(n) for n in self.segments])[None]

    def seq_params(self) -> Any:
        return packed_seq_params(self.segments)

    def model_input(self, tokens: torch.Tensor, pad_token_id: int) -> PackedInput:
        """The train engine's packed input for these [b, s] ``tokens`` (its losses keep reading the rows)."""
        return PackedInput(
            self.pack(tokens, pad_token_id), self.positions(), self.seq_params(), self._index()
        )


def packing_of(response_mask: torch.Tensor, multiple: int = 1) -> PackedRows:
    """The packing of a micro-batch's rows, each cut after its last response token (:func:`row_lengths`)."""
    return PackedRows.of(row_lengths(response_mask).tolist(), response_mask.shape[1], multiple)
