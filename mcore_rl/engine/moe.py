"""The router losses of a mixture-of-experts model around megatron's schedules: how they are scaled into the
global loss, and what is logged.

megatron's ``TopKRouter`` adds its load-balancing loss (``aux_loss``, the switch-transformer loss of each
micro-batch: ``E / (k * T^2) * sum_e tokens_e * sum_t p_te`` times the coefficient) and the optional z-loss
to the gradient through ``MoEAuxLossAutoScaler``, attaching ``loss * tokens_in_micro_batch`` in per-token
mode. ``TrainEngine``'s contract is that every loss term is its share of the *global* loss, so here the
scaler's backward scale is ``1 / T_global`` (every token the model computes in this forward-backward, over all
micro-batches and data-parallel ranks): the router terms then add the token-weighted mean of the
per-micro-batch losses, independent of how the batch is split over DP ranks and micro-batches. Padding and
packing filler count as tokens, as they do in megatron without a padding mask.

Expert parallelism exchanges tokens between EP ranks in every MoE layer of every micro-batch, so the ranks of
an EP group must run as many micro-batches (data-parallel ranks otherwise may differ: token budgets).
:func:`balanced_for_experts` appends filler micro-batches (one row of padding, no loss) up to the group's
maximum.

Logged values (:class:`RouterLosses`) are megatron's tracker values (each loss divided by its coefficient),
per MoE layer summed over micro-batches and divided by their number, averaged over the MoE layers and the
data-parallel ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.context import ParallelContext

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import MicroBatch

_TRACKED = {"load_balancing": "load_balancing_loss", "z_loss": "z_loss"}
"""Our field -> megatron's tracker name."""


@dataclass(frozen=True)
class RouterLosses:
    """The router's auxiliary losses of one forward-backward (None when that loss is off)."""

    load_balancing: float | None = None
    """megatron's ``aux_loss`` before its coefficient; 1.0 when tokens spread evenly over the experts."""
    z_loss: float | None = None
    """megatron's router z-loss before its coefficient."""


def _enabled(config: Any) -> dict[str, bool]:
    return {
        "load_balancing": bool(config.moe_aux_loss_coeff)
        and config.moe_router_load_balancing_type == "aux_loss",
        "z_loss": bool(config.moe_z_loss_coeff),
    }


@contextlib.contextmanager
def router_loss_scope(
    arch: ModelArch, ctx: ParallelContext, config: Any, num_tokens: Sequence[int], forward_only: bool
) -> Iterator[None]:
    """Around one schedule run: the router losses' backward scale is ``1 / T_global`` (see the module
    docstring), and megatron's tracker starts from zero. ``num_tokens``: model tokens of each of this rank's
    micro-batches (the whole sequence, before any sequence-parallel split). Collective when active."""
    if arch.moe is None or forward_only or not any(_enabled(config).values()):
        yield
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from mcore_rl.compat.moe import aux_loss_scale

    total = torch.tensor([float(sum(num_tokens))], dtype=torch.float64)
    dist.all_reduce(total, group=ctx.dp_group)
    clear_aux_losses_tracker()
    with aux_loss_scale(1.0 / float(total)):
        yield


def read_router_losses(
    arch: ModelArch, ctx: ParallelContext, config: Any, num_micro_batches: int
) -> RouterLosses:
    """Collective over the world: the tracker's values reduced as the module docstring says, then cleared."""
    if arch.moe is None:
        return RouterLosses()
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    out: dict[str, float | None] = {}
    for field, name in _TRACKED.items():
        if not _enabled(config)[field]:
            out[field] = None
            continue
        entry = tracker.get(name)
        values = torch.zeros(arch.num_layers, dtype=torch.float64)
        if entry is not None:  # a stage without MoE layers has no entry; its zeros still join the sums
            values += entry["values"].detach().to(torch.float64).cpu()
            entry["values"].zero_()
        for group in (ctx.pp_group, ctx.tp_group, ctx.dp_group):  # stages, SP token shards, replicas
            dist.all_reduce(values, group=group)
        # the load-balancing loss of a TP rank covers its share of the tokens (summed over TP, as megatron
        # logs it); the z-loss is each SP rank's own token mean (averaged over TP)
        shares = ctx.tp_size if field == "z_loss" else 1
        out[field] = float(values.sum()) / (len(arch.moe.layers) * num_micro_batches * ctx.dp_size * shares)
    return RouterLosses(**out)


@dataclass
class FillerMicroBatch:
    """A micro-batch that only keeps the expert-parallel exchange in step: the engine runs it through the model
    with a zero loss and returns no record for it."""

    tokens: torch.Tensor  # [1, s] padding
    position_ids: torch.Tensor  # [1, s]
    packed: None = None

    def to(self, device: torch.device) -> FillerMicroBatch:
        return FillerMicroBatch(self.tokens.to(device), self.position_ids.to(device))


def balanced_for_experts(
    micro_batches: list[MicroBatch], arch: ModelArch, ctx: ParallelContext
) -> list[MicroBatch]:
    """``micro_batches`` with fillers appended up to the most any rank of this rank's EP group runs
    (collective over that group; unchanged without expert parallelism)."""
    if arch.moe is None or ctx.ep_size == 1:
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ctx.ep_group)
    width = ctx.sequence_multiple  # sequence parallelism splits every sequence over TP
    filler = FillerMicroBatch(torch.zeros(1, width, dtype=torch.int64), torch.arange(width).unsqueeze(0))
    return micro_batches + [filler] * (int(count) - len(micro_batches))  # type: ignore[list-item]
