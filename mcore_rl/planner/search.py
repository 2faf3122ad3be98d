"""The smallest layout that fits, when the asked one does not, and the layout recommended on the GPUs asked for.

"Smallest" orders candidates by GPUs, then model-parallel size ``tp * pp`` (each split costs
communication), then the recompute mode (less recompute, less compute), then the rollout settings
(:func:`_rollout_settings`: the asked ones first). The global batch, sequence length, micro-batch size and GPU
model are the user's and stay fixed; SP is switched on whenever TP > 1 (it only removes memory, and megatron
requires it for mixture-of-experts models with TP > 1).

"Recommended" takes the candidates of the asked world size alone (DP fills what TP x PP x CP leave), ordered
by recompute mode first, then model-parallel size (:func:`recommended_layout` says why), and the first whose
peak leaves :data:`MARGIN_FRACTION` of the usable memory free. When none does, the fitting candidate with the
most headroom, reported as tight. Either proposal names every knob beyond the layout it changed, and why (:func:`knob_changes`).

Mixture-of-experts models also choose the expert split at each of those steps (``_expert_splits``): expert
parallelism ``ep`` among the divisors of the expert count, expert TP ``etp`` either 1 or ``tp``, with
``etp * ep`` dividing the ``tp * dp`` ranks of a stage and ``etp != tp`` only with ``ep > 1`` (megatron's
rules, checked again by :meth:`PlanInput.validate`). Splits whose EP group stays inside one node come
first, the largest EP first: its all-to-all runs over NVLink, and each rank then holds the fewest experts
(less weight and gradient memory, no expert gradient all-reduce over DP); ETP 1 before ETP ``tp`` (no TP
communication inside small experts, and fewer rows per rank: ``T k etp``). Splits across nodes come last,
the smallest first. A layout that a size does not divide is skipped, not proposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mcore_rl.planner.memory import MemoryPlan, gib, plan_memory
from mcore_rl.planner.spec import RECOMPUTE_MODES, PlanError, PlanInput

ROLLOUT_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Rollout reservations tried, besides the asked one (verl's advice: 0.5-0.7, up to 0.9 with offload)."""

MARGIN_FRACTION = 0.10
"""Headroom a recommended layout's peak leaves free, as a fraction of the usable memory (GPU memory less
``PlanInput.reserved_bytes``; ``mcore-rl plan --margin``). The fixed reserve holds the CUDA context and NCCL's
own buffers; what grows with the run is not in it: the caching allocator's fragmentation (RL's responses
change length every step, so activation blocks of new sizes split the cached ones), buffers of communicators
created later, and the error of the planner's activation formulas (estimates, not measurements). verl and
Megatron users keep 5-10% free for these (vLLM's default ``gpu_memory_utilization`` 0.9 leaves 10%); we take
the upper end because a run planned at 99% fails hours in, when fragmentation has grown, not at launch."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_splits(plan: PlanInput, world: int, tp: int, pp: int) -> list[tuple[int, int | None]]:
    """``(ep, etp)`` candidates for one (world, tp, pp), in the module docstring's order; ``etp`` None means
    ``tp`` (the recipe's spelling when they are equal). ``[(1, None)]`` for a dense model."""
    moe = plan.arch.moe
    if moe is None:
        return [(1, None)]
    stage_ranks = world // pp
    splits = [
        (ep, etp)
        for ep in _divisors(moe.num_experts)
        for etp in dict.fromkeys((1, tp))
        if stage_ranks % (ep * etp) == 0 and (ep > 1 or etp == tp)
    ]

    def order(split: tuple[int, int]) -> tuple[bool, int, bool]:
        ep, etp = split
        across_nodes = ep * etp > plan.gpus_per_node
        return across_nodes, ep if across_nodes else -ep, etp != 1

    return [(ep, None if etp == tp else etp) for ep, etp in sorted(splits, key=order)]


def _worlds(plan: PlanInput, max_gpus: int) -> list[int]:
    """Job sizes the smallest-layout search tries: part of a node, then whole nodes up to ``max_gpus``."""
    node = plan.gpus_per_node
    return sorted({*_divisors(node), *range(node, max_gpus + 1, node)})


def _train_candidates(plan: PlanInput, worlds: Iterable[int]) -> Iterator[list[PlanInput]]:
    """Training layouts in order: GPUs, then tp * pp, then pp, then recompute; each yielded as the list of its
    expert splits (one entry for a dense model), in the order they are tried."""
    node = plan.gpus_per_node
    recomputes = RECOMPUTE_MODES[RECOMPUTE_MODES.index(plan.recompute) :]
    for world in worlds:
        splits = [
            (tp, pp) for tp in _divisors(node) for pp in _divisors(plan.arch.num_layers) if tp * pp <= world
        ]
        for tp, pp in sorted(splits, key=lambda split: (split[0] * split[1], split[1])):
            experts = _expert_splits(plan, world, tp, pp)
            for recompute in recomputes:
                yield [
                    plan.with_layout(
                        world_size=world,
                        tp=tp,
                        pp=pp,
                        vpp=None,
                        sp=tp > 1,
                        ep=ep,
                        etp=etp,
                        recompute=recompute,
                    )
                    for ep, etp in experts
                ]


def _rollout_settings(plan: PlanInput) -> list[tuple[int, float]]:
    """``(rollout_tp, rollout_memory_fraction)`` pairs in the order tried at each training layout. The asked
    pair first, so that a proposal changes neither unless it must; then the asked fraction at the other rollout
    TP sizes (the rollout's own layout, the planner's to choose like the training's); only then lower
    fractions, the largest first (each takes KV cache, so rollout throughput), then higher ones (needed only
    when the KV cache cannot hold one sequence)."""
    asked = plan.rollout_memory_fraction
    fractions = [
        asked,
        *sorted((f for f in ROLLOUT_FRACTIONS if f < asked), reverse=True),
        *sorted(f for f in ROLLOUT_FRACTIONS if f > asked),
    ]
    sizes = [plan.rollout_tp, *(tp for tp in _divisors(plan.gpus_per_node) if tp != plan.rollout_tp)]
    return [(tp, fraction) for fraction in fractions for tp in sizes]


def _plan_or_none(plan: PlanInput) -> MemoryPlan | None:
    try:
        return plan_memory(plan)
    except PlanError:
        return None  # a split this model or batch does not allow


def _training_fits(plan: PlanInput) -> bool | None:
    """Whether the train phase fits (no rollout setting changes it: the rollout's weights are off the GPU
    while it sleeps); None when the layout is not valid."""
    first = _plan_or_none(plan.with_layout(rollout_tp=1))
    return None if first is None else first.train.fits


SPLIT_FREE_TERMS = (
    "weights",
    "gradients",
    "optimizer",
    "expert optimizer",
    "activations",
    "router logits",
    "LM head",
)
"""Train-phase terms no expert split of a (world, tp, pp, recompute) changes: the dense state and
activations, and the expert optimizer, ``12 E x / (tp dp)`` bytes per rank for experts of ``x`` parameters
whatever ``ep`` and ``etp`` (each rank holds ``1 / (etp ep)`` of them, sharded over ``edp = tp dp / (etp ep)``,
up to a byte of rounding). Their sum bounds every split of the group from below."""


def _no_split_fits(group: list[PlanInput]) -> bool:
    """True when even the split-free terms of the group overflow the GPU: no expert split can fit."""
    for candidate in group:
        result = _plan_or_none(candidate.with_layout(rollout_tp=1))
        if result is not None:
            bound = sum(result.train.terms.get(name, 0) for name in SPLIT_FREE_TERMS)
            return bound > result.train.capacity_bytes
    return True  # no valid split at all


def _fitting_layouts(plan: PlanInput, worlds: Iterable[int]) -> Iterator[MemoryPlan]:
    """Every candidate that validates and fits, in the module docstring's order."""
    settings = _rollout_settings(plan)
    for group in _train_candidates(plan, worlds):
        if len(group) > 1 and _no_split_fits(group):
            continue
        for candidate in group:
            if not _training_fits(candidate):
                continue  # invalid, or the training state alone overflows: no rollout choice can help
            for rollout_tp, fraction in settings:
                result = _plan_or_none(
                    candidate.with_layout(rollout_tp=rollout_tp, rollout_memory_fraction=fraction)
                )
                if result is not None and result.fits:
                    yield result


def smallest_fitting_layout(plan: PlanInput, max_gpus: int = 1024) -> MemoryPlan | None:
    """The first candidate (see the module docstring) that validates and fits, or None up to ``max_gpus``."""
    return next(_fitting_layouts(plan, _worlds(plan, max_gpus)), None)


def has_margin(result: MemoryPlan, margin: float = MARGIN_FRACTION) -> bool:
    """Whether ``result`` fits with ``margin`` of its usable memory left free at its peak."""
    return result.fits and result.headroom_bytes >= margin * result.capacity_bytes


def recommended_layout(plan: PlanInput, margin: float = MARGIN_FRACTION) -> MemoryPlan | None:
    """On ``plan.world_size`` GPUs: the fastest-looking candidate that leaves ``margin`` free, else the fitting
    one with the most headroom (tight: :func:`has_margin` is False), else None (nothing fits on these GPUs).

    Fastest-looking: the least recomputation first, then the least model parallelism (tp * pp, then pp).
    Full recomputation runs each layer's forward again, about a third more training compute, while TP within
    an NVLink node costs a megatron step far less than that (a 7B on 8 x A100-40 is TP4 without recompute
    rather than TP2 with it, as megatron's and verl's own 7B examples run); an asked recompute stays the floor."""
    rank = {mode: i for i, mode in enumerate(RECOMPUTE_MODES)}
    fitting = sorted(  # stable: each layout's asked rollout settings stay first
        _fitting_layouts(plan, [plan.world_size]),
        key=lambda r: (rank[r.plan.recompute], r.plan.tp * r.plan.pp, r.plan.pp),
    )
    safe = next((result for result in fitting if has_margin(result, margin)), None)
    return safe or max(fitting, key=lambda result: result.headroom_bytes, default=None)


KNOBS = ("recompute", "rollout_tp", "rollout_memory_fraction")
"""Settings a proposal may change beyond the layout (GPUs, TP, PP, VPP, SP, EP, ETP: the proposal itself);
each change is reported with its reason, since the user set these for reasons of their own."""


@dataclass(frozen=True)
class KnobChange:
    """One of :data:`KNOBS` a proposal sets differently from the asked run."""

    name: str
    asked: object
    proposed: object
    reason: str
    """What the proposed layout does with the asked value instead: the error, the phase that overflows, or
    the headroom short of the margin."""


def knob_changes(asked: PlanInput, proposal: MemoryPlan, margin: float = MARGIN_FRACTION) -> list[KnobChange]:
    """Each knob ``proposal`` changes from ``asked``, with why: the proposal put back to the asked value."""
    changes = []
    for name in KNOBS:
        old, new = getattr(asked, name), getattr(proposal.plan, name)
        if old != new:
            reason = _why_not(proposal.plan.with_layout(**{name: old}), margin)
            if name == "rollout_memory_fraction":  # its cost is the rollout's KV cache: say how much
                reason += f"; the KV cache holds {proposal.kv_cache_tokens:,} tokens per rollout rank"
            changes.append(KnobChange(name, old, new, reason))
    return changes


def _why_not(plan: PlanInput, margin: float) -> str:
    try:
        result = plan_memory(plan)
    except PlanError as err:
        return str(err)
    if not result.fits:
        return result.problems[0]
    peak_phase = max(result.phases, key=lambda phase: phase.total_bytes).name
    return (
        f"its peak ({peak_phase} phase) leaves {gib(result.headroom_bytes)} "
        f"({result.headroom_bytes / result.capacity_bytes:.1%}) of {gib(result.capacity_bytes)} usable free, "
        f"the margin is {margin * 100:g}%"
    )
