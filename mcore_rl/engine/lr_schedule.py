"""megatron's LR (and weight-decay) schedule over a TrainEngine's optimizers, from an ``optim`` config section."""

from __future__ import annotations

from typing import Any

from mcore_rl.config import OptimConfig
from mcore_rl.engine.train_engine import TrainEngine


def lr_scheduler(engine: TrainEngine, optim: OptimConfig, total_steps: int) -> Any:
    """megatron's OptimizerParamScheduler over every optimizer of the engine (warmup, then decay)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = max(optim.lr_decay_steps or total_steps, optim.lr_warmup_steps + 1)
    for optimizer in engine.optimizers:  # megatron's groups carry their own bounds
        for group in optimizer.param_groups:
            group["max_lr"], group["min_lr"] = optim.lr, optim.min_lr
    return OptimizerParamScheduler(
        engine.optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
