"""The smallest layout that fits, when the asked one does not.

"Smallest" orders candidates by GPUs, then model-parallel size ``tp * pp`` (each split costs
communication), then the recompute mode (less recompute, less compute), then the larger rollout memory
fraction is tried last. The global batch, sequence length, micro-batch size and GPU model are the user's
and stay fixed; SP is switched on whenever TP > 1 (it only removes memory).
"""

from __future__ import annotations

from collections.abc import Iterator

from mcore_rl.planner.memory import MemoryPlan, plan_memory
from mcore_rl.planner.spec import RECOMPUTE_MODES, PlanError, PlanInput

ROLLOUT_FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Rollout reservations tried, besides the asked one (verl's advice: 0.5-0.7, up to 0.9 with offload)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _train_candidates(plan: PlanInput, max_gpus: int) -> Iterator[PlanInput]:
    """Training layouts in order: GPUs, then tp * pp, then pp, then recompute."""
    node = plan.gpus_per_node
    worlds = sorted({*_divisors(node), *range(node, max_gpus + 1, node)})
    recomputes = RECOMPUTE_MODES[RECOMPUTE_MODES.index(plan.recompute) :]
    for world in worlds:
        splits = [
            (tp, pp) for tp in _divisors(node) for pp in _divisors(plan.arch.num_layers) if tp * pp <= world
        ]
        for tp, pp in sorted(splits, key=lambda split: (split[0] * split[1], split[1])):
            for recompute in recomputes:
                yield plan.with_layout(
                    world_size=world, tp=tp, pp=pp, vpp=None, sp=tp > 1, recompute=recompute
                )


def _plan_or_none(plan: PlanInput) -> MemoryPlan | None:
    try:
        return plan_memory(plan)
    except PlanError:
        return None  # a split this model or batch does not allow


def smallest_fitting_layout(plan: PlanInput, max_gpus: int = 1024) -> MemoryPlan | None:
    """The first candidate (see the module docstring) that validates and fits, or None up to ``max_gpus``."""
    fractions = sorted({plan.rollout_memory_fraction, *ROLLOUT_FRACTIONS})
    for candidate in _train_candidates(plan, max_gpus):
        first = _plan_or_none(candidate.with_layout(rollout_tp=1))
        if first is None:
            continue
        # The rollout settings only add to the train phase through the sleeping rollout weights: when the
        # training state alone overflows, no rollout choice can help.
        training_only = first.train.total_bytes - first.train.terms.get("rollout weights (asleep)", 0)
        if training_only > first.train.capacity_bytes:
            continue
        for rollout_tp in _divisors(plan.gpus_per_node):
            for fraction in fractions:
                result = _plan_or_none(
                    candidate.with_layout(rollout_tp=rollout_tp, rollout_memory_fraction=fraction)
                )
                if result is not None and result.fits:
                    return result
    return None
