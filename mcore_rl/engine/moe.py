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
    from mcore_rl.compat.moe import aux_loss_scale, router_token_shards

    total = torch.tensor([float(sum(num_tokens))], dtype=torch.float64)
    dist.all_reduce(total, group=ctx.dp_group)
    total /= router_token_shards(ctx.tp_size, ctx.cp_size)  # each router counts its shard's tokens
    for values in _tracked_values().values():
        values.zero_()
    with aux_loss_scale(1.0 / float(total)):
        yield


def _tracked_values() -> dict[str, torch.Tensor]:
    """Metric name -> its per-layer values in megatron's MoE tracker: ``moe_logging.get_moe_metrics_tracker``
    where it exists (megatron-core 0.17+, the legacy functions deprecated for removal), else the 0.16 dict."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}


def read_router_losses(
    arch: ModelArch, ctx: ParallelContext, config: Any, num_micro_batches: int
) -> RouterLosses:
    """Collective over the world: the tracker's values reduced as the module docstring says, then cleared.
    ``num_micro_batches``: this rank's, fillers not counted (data-parallel ranks may run different numbers)."""
    if arch.moe is None:
        return RouterLosses()
    tracker = _tracked_values()
    # the mean over every data-parallel rank's micro-batches (a rank's own count times DP doubled the logged
    # losses on a rank with fewer micro-batches than another under token budgets)
    counted = torch.tensor([num_micro_batches], dtype=torch.int64)
    dist.all_reduce(counted, group=ctx.dp_group)
    out: dict[str, float | None] = {}
    for field, name in _TRACKED.items():
        if not _enabled(config)[field]:
            out[field] = None
            continue
        entry = tracker.get(name)
        values = torch.zeros(arch.num_layers, dtype=torch.float64)
        if entry is not None:  # a stage without MoE layers has no entry; its zeros still join the sums
            values += entry.detach().to(torch.float64).cpu()
            entry.zero_()
        for group in (ctx.pp_group, ctx.tp_group, ctx.dp_group):  # stages, SP token shards, replicas
            dist.all_reduce(values, group=group)
        # the load-balancing loss of a TP rank covers its share of the tokens (summed over TP, as megatron
        # logs it); the z-loss is each SP rank's own token mean (averaged over TP)
        shares = ctx.tp_size if field == "z_loss" else 1
        out[field] = float(values.sum()) / (len(arch.moe.layers) * int(counted) * shares)
    return RouterLosses(**out)


@dataclass
class FillerMicroBatch:
    """A micro-batch that only keeps the expert-parallel exchange in step: the engine runs it through the model
    with a zero loss and returns no record for it."""

    tokens: torch.Tensor  # [1, s] padding
    position_ids: torch.Tensor  # [1, s]
    packed: None = None
    context: None = None
    """Never split over context-parallel ranks (MoE with CP is refused); read by the engine's model input."""

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
    return micro_batches + _fillers(ctx, int(count) - len(micro_batches))


def filled_for_interleaving(
    micro_batches: list[MicroBatch], ctx: ParallelContext, forward_only: bool
) -> list[MicroBatch]:
    """``micro_batches`` with fillers appended where megatron's interleaved (virtual pipeline) schedule needs
    more: a multiple of PP (it refuses a partial last group), and in a training step more than PP. With
    exactly PP every micro-batch of the first stage is a warm-up one, and megatron 0.16's shape exchange of
    variable-length batches then deadlocks (stage 0 sends its activations while stage 1 waits for shapes:
    found at PP2 x VPP2 with 2 micro-batches; 4 and 6 ran)."""
    pp = ctx.layout.pp
    if ctx.layout.num_model_chunks == 1:
        return micro_batches
    count = -(-len(micro_batches) // pp) * pp
    if not forward_only:
        count = max(count, 2 * pp)
    return micro_batches + _fillers(ctx, count - len(micro_batches))


def _fillers(ctx: ParallelContext, count: int) -> list[MicroBatch]:
    """``count`` one-row filler micro-batches, as short as a sequence may be (sequence parallelism splits
    every sequence over TP, context parallelism into 2 x CP chunks)."""
    width = ctx.sequence_multiple
    filler = FillerMicroBatch(torch.zeros(1, width, dtype=torch.int64), torch.arange(width).unsqueeze(0))
    return [filler] * count  # type: ignore[list-item]


@dataclass
class RoutingCounts:
    """How often the trainer's top-k experts equal the rollout's, over (token, MoE layer) pairs that the
    rollout routed (a set comparison: the order within the top-k does not matter)."""

    agreed: int = 0
    compared: int = 0
    active: bool = False
    """Count only while set (the update's first optimizer step: the weights that sampled the rollout)."""

    def fraction(self) -> float | None:
        return self.agreed / self.compared if self.compared else None


class _RouterTap:
    """Stands in for megatron's ``RouterReplay`` object on one ``TopKRouter`` (``router.router_replay``, read
    by ``topk_routing_with_score_function``): computes the router's own top-k, compares it with the rollout's
    choices for the current micro-batch, and with replay on returns the rollout's experts instead (the
    routing weights still come from this router's scores, so its gradient flows)."""

    def __init__(self, counts: RoutingCounts) -> None:
        self.counts = counts
        self.target: torch.Tensor | None = None  # [tokens, k] int64 in the model's token order, -1 unknown
        self.replay = False

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: Any, group_topk: Any, default_compute_topk: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is None:
            return probs, chosen
        if target.shape != chosen.shape:
            raise RuntimeError(
                f"router replay: {tuple(target.shape)} recorded choices for {tuple(chosen.shape)}"
            )
        known = (target >= 0).all(dim=1)
        if self.counts.active:
            same = (chosen.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
            self.counts.agreed += int((same & known).sum())
            self.counts.compared += int(known.sum())
        if not self.replay:
            return probs, chosen
        replayed = torch.where(known[:, None], target.to(chosen.dtype), chosen)
        return scores.gather(1, replayed), replayed


class RoutingTaps:
    """The taps of every MoE router in this rank's model chunks, in global layer order; see :class:`_RouterTap`.

    ``prepare(micro_batch)`` before each micro-batch's forward hands each tap that micro-batch's rollout choices
    in the order the router sees tokens: megatron's [s, b] sequence-major order (the packed row's order with
    remove-padding), this rank's slice of the sequence under sequence parallelism."""

    def __init__(
        self, chunks: list[Any], arch: ModelArch, ctx: ParallelContext, layer_offsets: list[int]
    ) -> None:
        assert arch.moe is not None
        self.arch, self.ctx = arch, ctx
        self.counts = RoutingCounts()
        self.taps: dict[int, _RouterTap] = {}  # index among the model's MoE layers -> tap
        for chunk, offset in zip(chunks, layer_offsets, strict=True):
            for local, layer in enumerate(chunk.decoder.layers):
                router = getattr(layer.mlp, "router", None)
                if router is None:
                    continue
                if not hasattr(router, "router_replay"):
                    raise RuntimeError(
                        "this megatron-core's TopKRouter has no router_replay hook (0.16+ needed)"
                    )
                tap = _RouterTap(self.counts)
                router.router_replay = tap
                self.taps[arch.moe.layers.index(offset + local)] = tap

    def set_replay(self, replay: bool) -> None:
        for tap in self.taps.values():
            tap.replay = replay

    def prepare(self, micro_batch: Any) -> None:
        """Hand every tap its share of ``micro_batch.expert_choices`` ([b, s, L, k]; None: none)."""
        choices = getattr(micro_batch, "expert_choices", None)
        if choices is None:
            for tap in self.taps.values():
                tap.target = None
            return
        ordered = _model_order(choices, micro_batch, self.ctx)  # [tokens, L, k]
        for moe_layer, tap in self.taps.items():
            tap.target = ordered[:, moe_layer].long()

    def clear(self) -> None:
        for tap in self.taps.values():
            tap.target = None

    def take_agreement(self) -> float | None:
        """Collective over the world: the fraction of compared (token, layer) pairs that agreed since the last
        call, over every rank (tokens are split over DP, SP and the pipeline's layers); None if none."""
        totals = torch.tensor([self.counts.agreed, self.counts.compared], dtype=torch.float64)
        dist.all_reduce(totals)
        self.counts.agreed = self.counts.compared = 0
        return float(totals[0] / totals[1]) if totals[1] > 0 else None


def _first_reader(source: torch.Tensor, total: int) -> torch.Tensor:
    """[total]: the first row position reading each packed token (``source``: the packed token at each row
    position, ``total`` where none); ``len(source)`` for a token no row reads (filler)."""
    rows = torch.arange(source.numel())
    read = source < total
    home = torch.full((total,), source.numel(), dtype=torch.long)
    return home.scatter_reduce(0, source[read], rows[read], "amin")


def _model_order(choices: torch.Tensor, micro_batch: Any, ctx: ParallelContext) -> torch.Tensor:
    """[b, s, L, k] per row position -> [tokens, L, k] in the order this rank's routers see the tokens."""
    b, s = choices.shape[:2]
    packed = micro_batch.packed
    if packed is None:
        ordered = choices.transpose(0, 1).reshape(s * b, *choices.shape[2:])  # megatron's [s, b]
    else:  # the packed row: token j sits at row position index[j]; filler tokens have no rollout routing
        flat = choices.reshape(b * s, *choices.shape[2:])
        total = packed.tokens.shape[1]
        ordered = torch.full((total, *choices.shape[2:]), -1, dtype=choices.dtype)
        if packed.source is None:
            ordered[: packed.index.numel()] = flat.index_select(0, packed.index.cpu())
        else:  # shared prompts: a prompt token is one packed token that every row of its group reads
            home = _first_reader(packed.source.cpu(), total)
            found = home < b * s
            ordered[found] = flat.index_select(0, home[found])
    if ctx.layout.sp and ctx.tp_size > 1:  # the rank's contiguous slice of the sequence dimension
        ordered = ordered.chunk(ctx.tp_size)[ctx.tp_rank]
    return ordered.to(ctx.device)
