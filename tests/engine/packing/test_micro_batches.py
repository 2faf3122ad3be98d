"""Micro-batching of the actor's and critic's passes (``engine/packing/micro_batches.py``), pure: how a
mini-batch is cut (fixed rows or token budgets), padded for sequence parallelism, and the outputs put back."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.packing.micro_batches import (
    at_rows,
    joined,
    micro_parts,
    mini_batch_slices,
    pad_record,
    pad_width,
    record_chunks,
    row_chunks,
)
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.types import TrainBatch


def _batch(lengths: list[int], width: int = 8) -> TrainBatch:
    """Rows whose response masks cover the first ``length`` positions; every tensor holds the row number."""
    rows = len(lengths)
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    fill = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, width)
    return TrainBatch(
        tokens=fill.long().clone(),
        response_mask=mask,
        old_log_probs=fill.clone(),
        advantages=fill.clone() * 10,
        ref_log_probs=fill.clone() * 100,
    )


def test_fixed_size_micro_batches_keep_row_order_and_every_field() -> None:
    batch = _batch([3, 5, 2, 8, 1, 4])
    parts = micro_parts(ParallelLayout(world_size=1), batch, micro_batch_size=2, token_budget=None)
    assert [rows for rows, _ in parts] == [[0, 1], [2, 3], [4, 5]]
    for rows, part in parts:
        assert part.tokens[:, 0].tolist() == rows  # tokens, advantages, ... are the same rows
        assert part.advantages[:, 0].tolist() == [10.0 * r for r in rows]
        assert part.tokens.shape[1] == 8  # fixed-size micro-batches are not trimmed


def test_token_budget_micro_batches_hold_every_row_once_within_budget_and_trimmed() -> None:
    batch = _batch([3, 5, 2, 7, 1, 4], width=8)
    lengths = [4, 6, 3, 8, 2, 5]  # columns each row needs: its mask and the token its last position predicts
    parts = micro_parts(ParallelLayout(world_size=1), batch, micro_batch_size=2, token_budget=10)
    assert sorted(r for rows, _ in parts for r in rows) == list(range(6))
    for rows, part in parts:
        longest = max(lengths[r] for r in rows)
        assert part.tokens.shape == (len(rows), longest)  # trimmed to the longest row
        assert len(rows) * longest <= 10 or len(rows) == 1  # within the budget (a long row goes alone)
        assert part.tokens[:, 0].tolist() == rows


def test_budget_widths_round_up_to_the_tp_size_under_sequence_parallelism() -> None:
    batch = _batch([3, 5, 2, 7], width=8)
    layout = ParallelLayout(world_size=2, tp=2, sp=True)
    for _, part in micro_parts(layout, batch, micro_batch_size=2, token_budget=8):
        assert part.tokens.shape[1] % 2 == 0


def test_budgets_need_a_single_pipeline_stage() -> None:
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu needs pipeline_model_parallel_size=1"):
        micro_parts(ParallelLayout(world_size=2, pp=2), _batch([1, 2]), 1, token_budget=4)


def test_outputs_go_back_to_their_rows() -> None:
    """A pass over budget micro-batches (rows out of order, trimmed) gives its outputs back in the
    mini-batch's row order, zero past each micro-batch's width; joined stacks fixed-size ones."""
    parts = [torch.full((2, 3), 1.0), torch.full((1, 5), 2.0)]
    full = at_rows(parts, [[2, 0], [1]], torch.Size([3, 6]))
    assert full[:, :5].tolist() == [[1, 1, 1, 0, 0], [2, 2, 2, 2, 2], [1, 1, 1, 0, 0]]
    assert full[:, 5].abs().sum() == 0
    stacked = joined([torch.ones(2, 6), torch.zeros(1, 6)], width=4)
    assert stacked.shape == (3, 4) and stacked[:2].sum() == 8 and stacked[2].sum() == 0


def test_rows_must_split_evenly_naming_the_field() -> None:
    assert [c.shape[0] for c in row_chunks(torch.zeros(6, 2), 3)] == [3, 3]
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu: 5 rows per rank"):
        row_chunks(torch.zeros(5, 2), 2)
    assert len(record_chunks(_batch([1, 2, 3, 4]), 2)) == 2
    assert mini_batch_slices(6, 3) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="ppo_mini_batch_size: 5 rows"):
        mini_batch_slices(5, 2)


def test_sequence_parallel_padding_pads_tokens_with_the_pad_id_and_the_rest_with_zeros() -> None:
    batch = _batch([2, 3], width=5)
    padded = pad_record(batch, multiple=4, pad_id=7)
    assert padded.tokens.shape == (2, 8) and padded.tokens[:, 5:].eq(7).all()
    assert padded.response_mask[:, 5:].abs().sum() == 0 and padded.advantages[:, 5:].abs().sum() == 0
    assert pad_record(batch, multiple=1, pad_id=7) is batch
    assert pad_width(torch.ones(1, 8), 4, 0.0).shape == (1, 8)


def test_mini_batch_slices_split_rows_evenly_or_name_the_field() -> None:
    assert mini_batch_slices(8, 2) == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="ppo_mini_batch_size: 6 rows per data-parallel rank"):
        mini_batch_slices(6, 4)
