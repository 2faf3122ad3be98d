"""Mixture-of-experts settings are checked before anything starts, each problem naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MOE = str(RECIPES / "moe_demo_cpu.yaml")
DENSE = str(RECIPES / "demo_cpu.yaml")

BAD = [
    (
        MOE,
        ["parallel.expert_model_parallel_size=3"],
        "expert_model_parallel_size=1*3 must divide the 2 ranks",
    ),
    (
        MOE,
        ["trainer.n_gpus_per_node=8", "parallel.expert_model_parallel_size=8", "data.train_batch_size=16"],
        "num_experts=4 is not divisible by expert_model_parallel_size=8",
    ),
    (MOE, ["parallel.expert_model_parallel_size=0"], "parallel.expert_model_parallel_size"),
    (
        MOE,
        ["model.hf_config.num_experts_per_tok=5"],
        "num_experts_per_tok=5 is larger than the number of experts",
    ),
    (
        MOE,
        ["model.hf_config.num_local_experts=four"],
        "num_local_experts must be a positive integer, got 'four'",
    ),
    (MOE, ["model.moe_aux_loss_coeff=-0.1"], "model.moe_aux_loss_coeff"),
    (
        MOE,
        ["rollout.tensor_model_parallel_size=2", "model.hf_config.intermediate_size=255"],
        "does not divide the experts' intermediate_size=255",
    ),
    (
        MOE,
        ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=1"],
        "needs sequence_parallel=true",
    ),
    (
        MOE,
        ["actor.router_replay=true", "rollout.name=vllm", "rollout.multi_turn.enable=true"],
        "actor.router_replay=true is not supported with rollout.multi_turn.enable=true",
    ),
    (
        MOE,
        ["actor.router_replay=true", "rollout.name=vllm", "trainer.device=cuda"],
        "actor.router_replay=true with rollout.name=vllm on CUDA",
    ),
    (
        DENSE,
        ["actor.router_replay=true"],
        "actor.router_replay=true applies to mixture-of-experts models only",
    ),
    (
        DENSE,
        ["trainer.n_gpus_per_node=2", "parallel.expert_model_parallel_size=2"],
        "the model has no experts",
    ),
]


@pytest.mark.parametrize(("recipe", "overrides", "expected"), BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_bad_moe_settings_name_the_key(recipe: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    assert expected in str(info.value)


def test_the_moe_recipe_is_valid_and_takes_the_checkpoints_aux_coefficient() -> None:
    from mcore_rl.trainer.build import worker_spec

    cfg = load_config(MOE)
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.model.moe_aux_loss_coeff is None
    assert worker_spec(cfg, total_optimizer_steps=1).moe_aux_loss_coeff == 0.001
