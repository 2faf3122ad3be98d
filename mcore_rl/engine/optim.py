"""The optimizer settings of a :class:`~mcore_rl.engine.train_engine.TrainEngine` (the ``optim``,
``sft.optim`` and ``critic.optim`` sections) and megatron's LR (and weight-decay) schedule over its optimizers.

:class:`OptimConfig` imports neither torch nor megatron, so the run config loads without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from mcore_rl.io.fields import NON_NEGATIVE, OPTIONAL_POSITIVE, POSITIVE, UNIT_INTERVAL, check_section, choice

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import TrainEngine


class LRDecayStyle(str, Enum):
    """megatron's ``OptimizerParamScheduler`` decay styles, after the warmup."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    INVERSE_SQUARE_ROOT = "inverse-square-root"


@dataclass
class OptimConfig:
    """Adam(W) as megatron runs it (fp32 main params and states, optionally sharded over DP) and the
    learning-rate schedule (megatron's ``OptimizerParamScheduler`` names)."""

    SECTION: ClassVar[str] = "optim"

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    lr_decay_style: str = LRDecayStyle.CONSTANT.value
    """constant, linear, cosine or inverse-square-root, after the warmup."""
    lr_decay_steps: int | None = None
    """Steps from the start to the end of the decay; None: the run's total optimizer steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""
    use_distributed_optimizer: bool | None = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1). None (the run config's default): on with GPUs,
    off on CPU ranks, where gloo's reduce-scatter costs as much as an all-reduce and the parameter all-gather
    comes on top (16 MB between two single-threaded ranks: 12.5 and 6.2 ms against the all-reduce's 10.8),
    while the memory a CPU host saves by sharding rarely decides anything."""

    def distributed_on(self, device_type: str) -> bool:
        """Whether the optimizer shards its state on ranks computing on ``device_type`` (cuda, cpu)."""
        if self.use_distributed_optimizer is None:
            return device_type != "cpu"
        return self.use_distributed_optimizer

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "lr": NON_NEGATIVE,
                "min_lr": NON_NEGATIVE,
                "lr_warmup_steps": NON_NEGATIVE,
                "lr_decay_style": choice(LRDecayStyle),
                "lr_decay_steps": OPTIONAL_POSITIVE,
                "weight_decay": NON_NEGATIVE,
                "adam_beta1": UNIT_INTERVAL,
                "adam_beta2": UNIT_INTERVAL,
                "adam_eps": POSITIVE,
                "clip_grad": NON_NEGATIVE,
            },
        )


def lr_scheduler(engine: TrainEngine, optim: OptimConfig, total_steps: int) -> Any:
    """megatron's OptimizerParamScheduler over every optimizer of the engine (warmup, then decay). A resumed
    run takes only the step count from its checkpoint and the schedule from its config (megatron's
    ``override_opt_param_scheduler``), as verl's scheduler does: a run resumed with more steps decays over
    them, where megatron's default took the checkpoint's warmup, horizon and style beside the config's peak
    (the added steps all at ``min_lr``)."""
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
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def megatron_adam(
    chunks: list[Any], optim: OptimConfig, params_dtype: Any, distributed: bool, gloo_groups: bool
) -> Any:
    """megatron's Adam over the DDP-wrapped ``chunks``, distributed (ZeRO-1) when ``distributed``;
    ``gloo_groups``: the gloo DP groups megatron asks for by default exist (ParallelContext builds them only on
    gloo worlds: an NCCL world failed on the first GPU run, "Intra partial data parallel group is not
    initialized")."""
    import torch  # here, not at the top: the run config loads this module without torch
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=distributed,
        ),
        chunks,
        use_gloo_process_groups=gloo_groups,
    )


def use_fused_torch_adam(optimizer: Any) -> None:
    """Switch torch's Adam(W), megatron's optimizer when neither TE nor apex is installed (the CPU case), to
    its fused kernel: one pass per tensor instead of ~8 (2.5x faster on CPU), same update to fp32 rounding.
    megatron builds it without a ``fused`` argument, and torch reads the flag per param group at each step;
    the step counters it creates on the first step follow the flag."""
    import torch  # here, not at the top: the run config loads this module without torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return  # TE's / apex's FusedAdam, or no optimizer on this rank
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fusable = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16) for p in params
    )
    if not fusable or optimizer.state:  # only before the first step: existing step counters stay as they are
        return
    for group in optimizer.param_groups:
        if not (group.get("differentiable") or group.get("capturable")):
            group.update(fused=True, foreach=False)
