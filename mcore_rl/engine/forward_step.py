"""One micro-batch through the model inside megatron's pipeline schedule: the ``forward_step_func`` of
:meth:`~mcore_rl.engine.train_engine.TrainEngine.forward_backward` and the loss callbacks it hands back.

The model's input is the micro-batch's padded rows, its packed tokens or a context-parallel rank's share of
them (:func:`model_input`); a loss always reads [b, s, ...] rows (:func:`unpacked`). A :class:`HeadLoss`
gets the final hidden states and this rank's vocab shard of the output weight instead of logits.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.engine.context_parallel import gather_rows
from mcore_rl.engine.lm_head import HeadLoss, LMHeadInput, full_hidden, output_weight, skip_output_layer
from mcore_rl.engine.moe import FillerMicroBatch, RoutingTaps
from mcore_rl.engine.weights import unwrap
from mcore_rl.parallel.context import ParallelContext

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import LossFn, MicroBatch

FILLER_RECORD = object()
"""The record of a :class:`FillerMicroBatch`, dropped from what ``forward_backward`` returns."""


def _filler_loss(output: torch.Tensor) -> tuple:
    return output.sum() * 0.0, torch.zeros((), dtype=torch.int, device=output.device), FILLER_RECORD


def forward_step(
    ctx: ParallelContext,
    loss_fn: LossFn[Any] | HeadLoss[Any],
    routing: RoutingTaps | None,
    keep_logits_bytes: int,
    data_iterator: Any,
    model: Any,
) -> tuple[torch.Tensor, Callable[..., Any]]:
    micro_batch: MicroBatch = next(data_iterator)
    tokens, positions, seq_params = model_input(micro_batch)
    if routing is not None:  # the routers see this micro-batch's rollout choices during its forward
        routing.prepare(micro_batch)
    if isinstance(micro_batch, FillerMicroBatch):  # keeps the EP group's exchanges in step; no loss
        # in eval mode: a training-mode router attached its load-balancing and z-losses of the filler's
        # padding to the backward (EP2 with one filler moved a router's gradient 4.5% off EP1's)
        was_training = model.training
        model.eval()
        try:
            return model(tokens, positions, None), _filler_loss
        finally:
            model.train(was_training)
    gpt = unwrap(model)
    if not isinstance(loss_fn, HeadLoss):
        output = model(tokens, positions, None, packed_seq_params=seq_params)  # [b, s, V/tp] or [1, T, ...]
        return output, partial(_loss_for_schedule, loss_fn, micro_batch)
    if not gpt.post_process:  # an earlier stage or chunk: its output feeds the next one
        return model(tokens, positions, None, packed_seq_params=seq_params), _no_loss
    with skip_output_layer(gpt):
        hidden = model(tokens, positions, None, packed_seq_params=seq_params)  # [s(/tp with SP), b, h]
    full = full_hidden(hidden, ctx)  # [b, s, h] or [1, T, h], this CP rank's tokens with CP
    shard = micro_batch.context
    local = full.reshape(-1, full.shape[-1]) if shard is not None else unpacked(full, micro_batch)
    head = LMHeadInput(local, output_weight(gpt), ctx, shard, keep_logits_bytes)
    return hidden, partial(_head_loss_for_schedule, loss_fn, micro_batch, head)


def model_input(micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(tokens, position ids, PackedSeqParams or None) as the model takes them."""
    if micro_batch.context is not None:
        return micro_batch.context.tokens, micro_batch.context.position_ids, micro_batch.context.seq_params
    packed = micro_batch.packed
    if packed is None:
        return micro_batch.tokens, micro_batch.position_ids, None
    return packed.tokens, packed.position_ids, packed.seq_params


def unpacked(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """A packed micro-batch's [1, T, X] model output as the [b, s, X] rows its loss reads (zeros at padding,
    which no loss reads; the gradient flows back to the packed positions), and a CP rank's output gathered
    into every row (``engine/context_parallel.py``); other outputs as they are."""
    if micro_batch.context is not None:
        return gather_rows(output.reshape(-1, output.shape[-1]), micro_batch.context)
    if micro_batch.packed is None:
        return output
    b, s = micro_batch.tokens.shape
    source = micro_batch.packed.source
    if source is not None:  # a gather: its backward sums a shared token's gradient over the rows reading it
        padded = torch.cat([output[0], output.new_zeros(1, output.shape[-1])])
        return padded.index_select(0, source).view(b, s, -1)  # backward: index_add_, not index_put_
    index = micro_batch.packed.index
    rows = output.new_zeros(b * s, output.shape[-1]).index_copy(0, index, output[0, : index.numel()])
    return rows.view(b, s, -1)


def _no_loss(output: torch.Tensor) -> tuple:
    raise AssertionError("megatron asked a stage without the output layer for a loss")


def _loss_for_schedule(loss_fn: LossFn[Any], micro_batch: MicroBatch, output: torch.Tensor) -> tuple:
    loss, metrics = loss_fn(unpacked(output, micro_batch), micro_batch)
    # The count only feeds megatron's logging; our finalize ignores it (see module docstring).
    return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics


def _head_loss_for_schedule(
    loss_fn: HeadLoss[Any], micro_batch: MicroBatch, head: LMHeadInput, output: torch.Tensor
) -> tuple:
    loss, metrics = loss_fn.fn(head, micro_batch)
    return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics
