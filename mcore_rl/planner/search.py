"""The smallest layout that fits, when the asked one does not.

"Smallest" orders candidates by GPUs, then model-parallel size ``tp * pp`` (each split costs
communication), then the recompute mode (less recompute, less compute), then the larger rollout memory
fraction is tried last. The global batch, sequence length, micro-batch size and GPU model are the user's
and stay fixed; SP is switched on whenever TP > 1 (it only removes memory, and megatron requires it for
mixture-of-experts models with TP > 1).

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

from collections.abc import Iterator

from mcore_rl.planner.memory import MemoryPlan, plan_memory
from mcore_rl.planner.spec import RECOMPUTE_MODES, PlanError, PlanInput

ROLLOUT_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Rollout reservations tried, besides the asked one (verl's advice: 0.5-0.7, up to 0.9 with offload)."""


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


def _train_candidates(plan: PlanInput, max_gpus: int) -> Iterator[list[PlanInput]]:
    """Training layouts in order: GPUs, then tp * pp, then pp, then recompute; each yielded as the list of its
    expert splits (one entry for a dense model), in the order they are tried."""
    node = plan.gpus_per_node
    worlds = sorted({*_divisors(node), *range(node, max_gpus + 1, node)})
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


def smallest_fitting_layout(plan: PlanInput, max_gpus: int = 1024) -> MemoryPlan | None:
    """The first candidate (see the module docstring) that validates and fits, or None up to ``max_gpus``."""
    fractions = sorted({plan.rollout_memory_fraction, *ROLLOUT_FRACTIONS})
    for group in _train_candidates(plan, max_gpus):
        if len(group) > 1 and _no_split_fits(group):
            continue
        for candidate in group:
            if not _training_fits(candidate):
                continue  # invalid, or the training state alone overflows: no rollout choice can help
            for rollout_tp in _divisors(plan.gpus_per_node):
                for fraction in fractions:
                    result = _plan_or_none(
                        candidate.with_layout(rollout_tp=rollout_tp, rollout_memory_fraction=fraction)
                    )
                    if result is not None and result.fits:
                        return result
    return None
