"""Micro-batches of the actor's and critic's passes, cut from whole records: fixed row counts or token budgets,
padded for sequence and context parallelism, and the passes' per-row outputs joined back (pure tensor code)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mcore_rl.engine.packing.shared_prefix import shared_prefix_packing
from mcore_rl.engine.packing.token_batching import (
    budget_micro_batches,
    packing_of,
    row_lengths,
    select_rows,
    trim_columns,
)
from mcore_rl.engine.train_engine import MicroBatch
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.types import TrainBatch


def positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def plain_micro_batch(tokens: torch.Tensor) -> MicroBatch:
    return MicroBatch(tokens, positions(tokens))


def row_chunks(
    tensor: torch.Tensor, size: int, key: str = "algorithm.ppo_micro_batch_size_per_gpu"
) -> list[torch.Tensor]:
    """``tensor``'s rows in micro-batches of ``size``; ``key`` names the setting a bad split comes from."""
    if size < 1 or tensor.shape[0] % size:
        raise ValueError(
            f"{key}: {tensor.shape[0]} rows per rank do not split into micro-batches of {size} (pipeline "
            "schedules need equal micro-batches)"
        )
    return list(tensor.split(size))


def packed(
    micro: MicroBatch,
    mask: torch.Tensor,
    multiple: int,
    pad_token_id: int,
    *,
    remove_padding: bool,
    share_prompt_prefix: bool = False,
) -> MicroBatch:
    """``micro`` with its rows packed end to end for the model (``model.use_remove_padding``), each cut after
    the last position ``mask`` reads, or with each shared prompt once (``model.share_prompt_prefix``); as it is
    otherwise. ``multiple``: the sequence-parallel multiple packed lengths are padded to."""
    if share_prompt_prefix:
        micro.packed = shared_prefix_packing(micro.tokens, mask, multiple, pad_token_id).model_input()
    elif remove_padding:
        micro.packed = packing_of(mask, multiple).model_input(micro.tokens, pad_token_id)
    return micro


def micro_parts(
    layout: ParallelLayout, mini: TrainBatch, micro_batch_size: int, token_budget: int | None
) -> list[tuple[list[int], TrainBatch]]:
    """Micro-batches of a mini-batch, each with its rows of the mini-batch: ``micro_batch_size`` rows each,
    or at most ``token_budget`` tokens per GPU each and trimmed to their longest row (``token_batching.py``;
    pipeline schedules need equal shapes). Under context parallelism a GPU runs ``1 / CP`` of every row, so a
    micro-batch may hold ``CP x token_budget`` tokens (verl's ``ppo_max_token_len_per_gpu * cp``), its width
    rounded up to the layout's sequence multiple."""
    if token_budget is None:
        size = micro_batch_size
        return [
            (list(range(i * size, i * size + part.tokens.shape[0])), part)
            for i, part in enumerate(record_chunks(mini, size))
        ]
    if layout.pp > 1:
        raise ValueError("algorithm.ppo_max_token_len_per_gpu needs pipeline_model_parallel_size=1")
    lengths = row_lengths(mini.response_mask).tolist()
    multiple = layout.sequence_multiple
    return [
        (rows, select_rows(mini, rows, trim_columns(max(lengths[i] for i in rows), multiple)))
        for rows in budget_micro_batches(lengths, token_budget * layout.cp)
    ]


def at_rows(parts: list[torch.Tensor], rows: list[list[int]], shape: torch.Size) -> torch.Tensor:
    """[N, S]: each micro-batch's [b, s] output put back at its rows of the mini-batch (token-budget
    micro-batches hold rows out of order, trimmed to fewer columns)."""
    full = torch.zeros(shape)
    for part, index in zip(parts, rows, strict=True):
        full[index, : part.shape[1]] = part.float()
    return full


def joined(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """The micro-batches' [b, s] outputs stacked in row order and cut to ``width`` columns."""
    return torch.cat(parts)[:, :width]


def slice_rows(batch: TrainBatch, rows: slice) -> TrainBatch:
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    sliced: dict[str, Any] = {name: None if value is None else value[rows] for name, value in fields.items()}
    return TrainBatch(**sliced)


def record_chunks(batch: TrainBatch, size: int) -> list[TrainBatch]:
    row_chunks(batch.tokens, size)  # validates
    num = batch.tokens.shape[0] // size
    return [slice_rows(batch, slice(i * size, (i + 1) * size)) for i in range(num)]


def pad_width(tensor: torch.Tensor, multiple: int, value: float) -> torch.Tensor:
    """Right-pad columns to a multiple of ``multiple`` (sequence parallelism splits positions over TP)."""
    extra = -tensor.shape[1] % multiple
    return torch.nn.functional.pad(tensor, (0, extra), value=value) if extra else tensor


def pad_record(batch: TrainBatch, multiple: int, pad_id: int) -> TrainBatch:
    if multiple == 1:
        return batch
    padded: dict[str, torch.Tensor | None] = {
        f.name: pad_width(getattr(batch, f.name), multiple, 0.0)
        for f in dataclasses.fields(batch)
        if f.name != "expert_choices"
    }
    padded["tokens"] = pad_width(batch.tokens, multiple, pad_id)
    padded["expert_choices"] = pad_positions(batch.expert_choices, multiple)
    return TrainBatch(**padded)  # type: ignore[arg-type]


def pad_positions(choices: torch.Tensor | None, multiple: int) -> torch.Tensor | None:
    """[N, S, L, k] routing records right-padded along the positions to a multiple of ``multiple``, with -1
    (nothing routed there)."""
    if choices is None:
        return None
    extra = -choices.shape[1] % multiple
    return torch.nn.functional.pad(choices, (0, 0, 0, 0, 0, extra), value=-1) if extra else choices


def mini_batch_slices(num_rows: int, num_mini_batches: int) -> list[slice]:
    """Contiguous row slices of one data-parallel shard, one per mini-batch (the k-th mini-batch of the
    step is the k-th slice of every shard)."""
    if num_mini_batches < 1 or num_rows % num_mini_batches:
        raise ValueError(
            f"algorithm.ppo_mini_batch_size: {num_rows} rows per data-parallel rank do not split into "
            f"{num_mini_batches} mini-batches"
        )
    size = num_rows // num_mini_batches
    return [slice(i * size, (i + 1) * size) for i in range(num_mini_batches)]
