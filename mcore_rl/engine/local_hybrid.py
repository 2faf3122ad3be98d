"""A train engine and the embedded rollout engine joined by the 3D-HybridEngine: the wiring, in one place."""

from __future__ import annotations

from mcore_rl.engine.lora import rollout_parameters
from mcore_rl.engine.rollout.from_megatron import rollout_tensors
from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.engine.rollout.local import LocalRolloutEngine
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.parallel.config import HybridConfig
from mcore_rl.parallel.reshard import arch_param_specs, build_plan
from mcore_rl.parallel.reshard.hybrid import HybridEngine


def build_local_hybrid(
    engine: TrainEngine, tp_g: int = 1, config: HybridConfig | None = None
) -> tuple[HybridEngine, LocalRolloutEngine]:
    """Collective: the reshard plan from ``engine``'s layout to rollout TP ``tp_g``, a
    :class:`LocalRolloutEngine` on its rollout TP group, and the :class:`HybridEngine` switching between them."""
    arch, ctx = engine.arch, engine.ctx
    plan = build_plan(
        arch_param_specs(arch),
        ctx.layout,
        tp_g,
        num_layers=arch.num_layers,
        tied_embeddings=arch.tie_word_embeddings,
        vocab_divisible_by=engine.options.make_vocab_size_divisible_by,  # the shards' padding, as trained
        rollout_vocab_divisible_by=VOCAB_DIVISIBLE_BY,  # the embedded engine's own
    )
    group = ctx.subgroup(plan.rollout_groups()) if tp_g > 1 else None
    rollout = LocalRolloutEngine(arch, tp_group=group, device=ctx.device)  # the training ranks' device
    hybrid = HybridEngine(
        engine,
        rollout,
        plan,
        local_params=lambda: dict(rollout_parameters(engine.models, arch, ctx)),  # LoRA merged
        to_rollout_tensors=lambda shards: rollout_tensors(shards, arch),
        config=config,
        ctx=ctx,
    )
    return hybrid, rollout
