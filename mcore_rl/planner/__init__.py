"""Memory and parallelism planner: per-GPU bytes of each phase of a colocated RL run, before launch.

Pure arithmetic over a :class:`~mcore_rl.engine.arch.ModelArch` and a layout (no process groups); see
``memory.py`` for the phases, ``activations.py`` for the activation formulas and their sources, ``moe.py`` for
the mixture-of-experts terms (expert activations, router tensors, dispatcher buffers, the rollout's experts).
"""

from mcore_rl.engine.params import (
    RankParams,
    active_params,
    layer_params,
    model_params,
    rank_params,
    stage_params,
    stage_split,
)
from mcore_rl.planner.memory import MemoryPlan, PhaseMemory, TrainState, plan_memory, train_state
from mcore_rl.planner.search import MARGIN_FRACTION, recommended_layout, smallest_fitting_layout
from mcore_rl.planner.spec import GPU_MEMORY_BYTES, PlanError, PlanInput

__all__ = [
    "GPU_MEMORY_BYTES",
    "MARGIN_FRACTION",
    "MemoryPlan",
    "PhaseMemory",
    "PlanError",
    "PlanInput",
    "RankParams",
    "TrainState",
    "active_params",
    "layer_params",
    "model_params",
    "plan_memory",
    "rank_params",
    "recommended_layout",
    "smallest_fitting_layout",
    "stage_params",
    "stage_split",
    "train_state",
]
