"""The real-model recipes load into the run-config schema and fit their GPUs according to the planner, with
the layout and the numbers their comments state."""

from __future__ import annotations

import json

import pytest

from mcore_rl.config import load_config
from mcore_rl.planner import plan_memory
from mcore_rl.planner.from_config import plan_input_from_config
from tests.planner.hf_configs import LLAMA31_8B, LLAMA31_70B

GIB = 1 << 30

# recipe -> (model config, world, tp, pp, vpp, dp, rollout tp, GiB to spare in the worst phase)
RECIPES = {
    "recipes/llama3_8b_grpo_a100.yaml": (LLAMA31_8B, 8, 2, 1, None, 4, 2, 22),
    "recipes/llama3_70b_grpo_a100.yaml": (LLAMA31_70B, 32, 8, 4, 5, 1, 8, 30),
}


@pytest.fixture(params=sorted(RECIPES))
def recipe(request, tmp_path):
    """(recipe path, its config with model.path pointing at a folder holding the model's config.json)."""
    hf_config = RECIPES[request.param][0]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    return request.param, load_config(request.param, [f"model.path={tmp_path}"])


def test_recipe_loads_and_fits_an_a100_80(recipe):
    path, cfg = recipe
    _, world, tp, pp, vpp, dp, rollout_tp, spare_gib = RECIPES[path]
    plan = plan_input_from_config(cfg, gpu="A100-80")
    assert (plan.world_size, plan.tp, plan.pp, plan.vpp, plan.dp, plan.rollout_tp) == (
        world,
        tp,
        pp,
        vpp,
        dp,
        rollout_tp,
    )
    assert plan.sp and plan.bf16 and plan.reference  # SP on, bf16 weights, KL loss -> colocated reference
    result = plan_memory(plan)
    assert result.fits, result.problems
    assert round((result.train.capacity_bytes - result.peak_bytes) / GIB) == spare_gib
    assert f"fits with ~{spare_gib} GiB to spare" in _header(path)


def test_llama_70b_recipe_numbers_in_its_comments():
    cfg = load_config("recipes/llama3_70b_grpo_a100.yaml", ["model.path=/nonexistent"])
    from mcore_rl.engine.arch import ModelArch

    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(LLAMA31_70B), gpu="A100-80")
    result = plan_memory(plan)
    state = result.train.terms
    assert round((state["weights"] + state["gradients"] + state["optimizer"]) / GIB) == 38
    assert round(state["reference weights"] / GIB, 1) == 4.2 and round(result.train.total_bytes / GIB) == 47
    assert round(result.rollout.terms["rollout weights"] / GIB, 1) == 16.4
    assert round(result.kv_cache_tokens, -4) == 390_000
    # The alternative it weighs: PP=2 (DP=2) fits too, with less to spare.
    pp2 = plan_memory(plan.with_layout(pp=2, vpp=None))
    assert pp2.fits and round(pp2.train.total_bytes / GIB) == 62


def test_llama_8b_recipe_numbers_in_its_comments():
    from mcore_rl.engine.arch import ModelArch

    cfg = load_config("recipes/llama3_8b_grpo_a100.yaml", ["model.path=/nonexistent"])
    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(LLAMA31_8B), gpu="A100-80")
    result = plan_memory(plan)
    state = result.train.terms
    assert round((state["weights"] + state["gradients"] + state["optimizer"]) / GIB) == 34
    assert round(state["reference weights"] / GIB, 1) == 7.5
    assert result.kv_cache_tokens // 1536 == 340
    tp1 = plan_memory(plan.with_layout(tp=1, sp=False))
    assert round((tp1.actor.weights_bytes + tp1.actor.grads_bytes + tp1.actor.optimizer_bytes) / GIB) == 56
    assert not tp1.train.fits and round(tp1.train.total_bytes / GIB) == 98


def test_qwen25_7b_ppo_recipe_plans_a_critic_and_the_numbers_in_its_comments():
    from mcore_rl.engine.arch import ModelArch
    from tests.planner.hf_configs import QWEN25_7B

    cfg = load_config("recipes/qwen2_5_7b_ppo_a100.yaml", ["model.path=/nonexistent"])
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.colocate and cfg.algorithm.use_kl_in_reward
    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(QWEN25_7B), gpu="A100-80")
    assert (plan.world_size, plan.tp, plan.pp, plan.dp, plan.rollout_tp) == (8, 4, 1, 2, 2)
    assert plan.critic and plan.reference and plan.sp and plan.bf16
    result = plan_memory(plan)
    assert result.fits, result.problems
    assert round(result.peak_bytes / GIB, 1) == round(result.rollout.total_bytes / GIB, 1) == 58.9
    assert round(result.train.total_bytes / GIB, 1) == 51.5
    rollout = result.rollout.terms  # the critic's gradients and optimizer stay through the rollout
    assert round((rollout["critic gradients"] + rollout["critic optimizer"]) / GIB, 1) == 16.5
    state = result.train.terms
    assert (
        round((state["critic weights"] + state["critic gradients"] + state["critic optimizer"]) / GIB) == 20
    )
    assert round(result.kv_cache_tokens, -5) == 900_000
    # The rejected alternative: TP2 (DP4) does not fit the train phase.
    tp2 = plan_memory(plan.with_layout(tp=2))
    assert not tp2.train.fits and round(tp2.train.total_bytes / GIB) == 82


def test_qwen3_8b_recipe_fits_an_h100_80_with_the_numbers_in_its_comments(tmp_path):
    from tests.planner.hf_configs import QWEN3_8B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = load_config("recipes/qwen3_8b_grpo_h100.yaml", [f"model.path={tmp_path}"])
    plan = plan_input_from_config(cfg, gpu="H100-80")
    assert (plan.world_size, plan.tp, plan.pp, plan.dp, plan.rollout_tp) == (8, 2, 1, 4, 2)
    assert plan.arch.qk_norm and plan.arch.head_dim == 128 and plan.sp and plan.reference
    result = plan_memory(plan)
    assert result.fits, result.problems
    assert round(result.actor.params / 1e9, 1) == 4.1
    assert round(result.train.total_bytes / GIB, 1) == 55.9 and result.peak_bytes == result.train.total_bytes
    assert round((result.train.capacity_bytes - result.peak_bytes) / GIB) == 21
    assert round(result.kv_cache_tokens, -4) == 460_000 and result.kv_bytes_per_token == 73_728


def _header(path: str) -> str:
    """A recipe's leading comment as one line of text (line breaks are where the wrapping fell)."""
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:].strip())
    return " ".join(lines)


def test_qwen3_30b_a3b_recipe_fits_two_h100_nodes_with_the_figures_in_its_header(tmp_path):
    from mcore_rl.planner.memory import gib
    from tests.planner.hf_configs import QWEN3_30B_A3B

    path = "recipes/qwen3_30b_a3b_grpo_h100.yaml"
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = load_config(path, [f"model.path={tmp_path}"])
    assert cfg.rollout.name == "vllm" and cfg.model.moe_aux_loss_coeff == 0.0
    plan = plan_input_from_config(cfg, gpu="H100-80")
    layout = (plan.world_size, plan.tp, plan.pp, plan.dp, plan.ep, plan.layout.expert_tp, plan.expert_dp)
    assert layout == (16, 4, 1, 4, 8, 1, 2) and plan.rollout_tp == 4
    assert plan.sp and plan.reference
    result = plan_memory(plan)
    assert result.fits, result.problems
    header, train = _header(path), result.train.terms
    quoted = [
        f"{result.model_params / 1e9:.1f}B parameters, {result.active_params / 1e9:.2f}B used per token",
        f"A rank holds {result.actor.params / 1e9:.2f}B parameters, {result.actor.expert_params / 1e9:.2f}B",
        f"its {128 // plan.ep} whole experts",
        *(
            f"{name} {gib(train[name])}"
            for name in (
                "expert weights",
                "expert gradients",
                "expert optimizer",
                "reference weights",
                "expert activations",
                "activations",
                "LM head",
                "dispatcher buffers",
                "router logits",
            )
        ),
        f"the {(result.actor.params - result.actor.expert_params) / 1e9:.2f}B dense ones (attention, routers, "
        f"the vocabulary padded to 152,064 rows) "
        f"{train['weights'] / GIB:.1f} + {train['gradients'] / GIB:.1f} + {train['optimizer'] / GIB:.1f} GiB",
        f"train phase {gib(result.train.total_bytes)}, the largest",
        f"~{round((result.train.capacity_bytes - result.peak_bytes) / GIB)} GiB left",
        f"rollout weights {gib(result.rollout.terms['rollout weights'])}",
        f"kv cache {gib(result.rollout.terms['kv cache'])}",
        f"{result.kv_cache_tokens:,} tokens per engine ({result.kv_bytes_per_token:,} B per token",
        f"{result.kv_cache_tokens // plan.seq_length} full {plan.seq_length}-token sequences",
    ]
    missing = [phrase for phrase in quoted if phrase not in header]
    assert not missing, missing
    assert result.peak_bytes == result.train.total_bytes  # the train phase is the largest
    # The rejected alternative, one node: expert-DP1 leaves the expert optimizer unsharded, and even
    # micro-batch 1 leaves under half a GiB (micro-batch 2 does not fit).
    one_node = plan.with_layout(world_size=8, gpus_per_node=8)
    assert not plan_memory(one_node).fits
    tight = plan_memory(one_node.with_layout(micro_batch_size=1))
    assert tight.fits and f"expert optimizer {gib(tight.train.terms['expert optimizer'])} unsharded" in header
    assert f"leaves {(tight.train.capacity_bytes - tight.peak_bytes) / GIB:.1f} GiB" in header
