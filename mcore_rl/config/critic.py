"""Schema section ``critic``: the value model of PPO (``algorithm.adv_estimator=gae``), verl's ``critic`` keys.

The critic is the actor's architecture with a scalar value head (``engine/model.py`` ``ValueHead``), trained
by the clipped value loss on the GAE returns, with its own optimizer, learning-rate schedule and checkpoint
(``<run checkpoint>/critic``). It lives on the actor's ranks (``colocate``, sharing their layout) or on its own pool with its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mcore_rl.engine.optim import OptimConfig
from mcore_rl.io.fields import NON_NEGATIVE, POSITIVE, check_section
from mcore_rl.parallel.config import ParallelConfig


def _critic_optim() -> OptimConfig:
    # verl's critic default: a learning rate 10x the actor's (the value head starts from scratch).
    return OptimConfig(lr=1e-5, weight_decay=0.0, use_distributed_optimizer=None)


@dataclass
class CriticConfig:
    """The value model: initialisation, layout, optimizer, micro-batching, value clipping and warm-up."""

    SECTION: ClassVar[str] = "critic"

    model_path: str | None = None
    """An HF folder (safetensors, e.g. the actor's base model) whose transformer body starts the critic;
    None starts it from the actor's weights at the beginning of RL (after the SFT warm start). The value
    head always starts from a seeded random init. On its own pool the actor's weights travel through the
    driver whole: fine for small models; give large ones a path."""
    colocate: bool = True
    """True: train the critic on the actor's ranks, in the same processes (HybridFlow's colocated
    placement). False: on its own resource pool of ``num_ranks`` ranks, where its values run concurrently
    with the actor's log-probs."""
    num_ranks: int = 1
    """Ranks of the critic's own pool (``colocate=false``; GPUs, or worker processes on CPU)."""
    parallel: ParallelConfig | None = None
    """The critic's training layout; None: the actor's (``parallel``). A colocated critic shares the
    actor's processes, hence its layout: a different one is refused. On its own pool any layout that
    divides ``num_ranks``."""
    optim: OptimConfig = field(default_factory=_critic_optim)
    """Optimizer and learning-rate schedule of the critic (its own Adam state and scheduler)."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per critic forward/backward on one data-parallel rank."""
    cliprange_value: float = 0.5
    """Value clipping: the new value stays within this of the rollout-time value in the loss."""
    warmup_steps: int = 0
    """RL steps at the start of the run that train the critic only (the actor is frozen for exactly these;
    verl's ``critic_warmup=N`` freezes N - 1)."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "num_ranks": POSITIVE,
                "ppo_micro_batch_size_per_gpu": POSITIVE,
                "cliprange_value": NON_NEGATIVE,
                "warmup_steps": NON_NEGATIVE,
            },
        )
