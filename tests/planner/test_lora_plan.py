"""LoRA in the memory planner: the adapters' count is peft's, a built LoRA engine holds exactly the planned
weights, gradient buffers and optimizer state at TP2+SP, PP2 and DP2 (the self-check), the reference costs
nothing, and the 8B LoRA recipe fits fewer GPUs than the full fine-tune with the numbers in its header."""

from __future__ import annotations

import pytest

from mcore_rl.config import load_config
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.peft import adapter_shapes
from mcore_rl.engine.lora_spec import ATTENTION_TARGETS, TARGETS, LoRASpec, resolve_targets
from mcore_rl.planner import PlanInput, plan_memory
from mcore_rl.planner.from_config import plan_input_from_config
from mcore_rl.planner.lora import model_adapter_params, stage_adapter_params
from mcore_rl.planner.selfcheck import self_check_reports
from mcore_rl.planner.spec import PlanError
from tests.models import tiny_arch
from tests.planner.hf_configs import LLAMA31_8B

GIB = 1 << 30
SOME = resolve_targets(["q_proj", "v_proj", "up_proj", "down_proj"])
# (tp, pp, bf16, targets, family, ep) on 2 ranks; the mixture-of-experts model adapts its attention only, its
# experts split over both ranks (EP2, folded into DP2)
LAYOUTS = [
    (2, 1, True, tuple(TARGETS), "llama", 1),
    (1, 2, False, SOME, "llama", 1),
    (1, 1, True, tuple(TARGETS), "llama", 1),
    (1, 1, False, ATTENTION_TARGETS, "qwen3_moe", 2),
]


def _plan(
    tp: int,
    pp: int,
    bf16: bool,
    targets: tuple[str, ...],
    family: str = "llama",
    ep: int = 1,
    rank: int = 4,
) -> PlanInput:
    return PlanInput(
        arch=tiny_arch(family),
        gpu="A100-80",
        world_size=2,
        tp=tp,
        pp=pp,
        sp=tp > 1,
        ep=ep,
        seq_length=16,
        bf16=bf16,
        lora_rank=rank,
        lora_targets=targets,
    )


def test_the_adapter_count_is_a_peft_adapters() -> None:
    arch = tiny_arch("llama")
    for targets in (tuple(TARGETS), SOME):
        spec = LoRASpec(rank=4, alpha=8.0, targets=targets)
        numel = sum(a * b for a, b in adapter_shapes(spec, arch).values())
        assert model_adapter_params(arch, 4, targets) == numel


def _self_check_all() -> list:
    return [self_check_reports(_plan(*layout))[1] for layout in LAYOUTS]


def test_a_lora_engine_holds_what_the_planner_says(run_distributed) -> None:
    rank0, _ = run_distributed(_self_check_all, world_size=2)
    for layout, reports in zip(LAYOUTS, rank0, strict=True):
        assert all(not problems for _, problems in reports), (layout, reports)
    (tp2, _), _ = rank0[0]
    assert tp2.grads_bytes < tp2.weights_bytes / 2  # the base has no gradient buffer


def test_lora_drops_the_reference_and_the_base_state_and_adds_the_merged_sync_copy() -> None:
    cfg = load_config("recipes/llama3_8b_grpo_a100.yaml", ["model.path=/nonexistent"])
    full = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(LLAMA31_8B), gpu="A100-80")
    lora = plan_memory(full.with_layout(lora_rank=64))
    terms = lora.train.terms
    adapters = stage_adapter_params(full.arch, full.layout, 0, 64, tuple(TARGETS))  # TP2: A or B whole
    assert model_adapter_params(full.arch, 64, tuple(TARGETS)) // 2 < adapters
    assert "reference weights" not in terms and "reference weights" in plan_memory(full).train.terms
    assert terms["gradients"] == 4 * adapters and terms["optimizer"] == 12 * adapters // 4  # DP4
    assert round(lora.switch.terms["merged LoRA weights"] / GIB, 1) == 6.5  # every linear, TP2, bf16


def test_the_8b_lora_recipe_fits_two_gpus_with_its_header_numbers() -> None:
    cfg = load_config("recipes/llama3_8b_lora_grpo_a100.yaml", ["model.path=/nonexistent"])
    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(LLAMA31_8B), gpu="A100-80")
    assert (plan.world_size, plan.tp, plan.dp, plan.rollout_tp, plan.lora_rank) == (2, 1, 2, 1, 64)
    assert plan.reference and cfg.model.lora_alpha == 32
    result = plan_memory(plan)
    assert result.fits, result.problems
    terms = result.train.terms
    assert round(model_adapter_params(plan.arch, 64, plan.lora_targets) / 1e6) == 168
    assert (round(terms["gradients"] / GIB, 1), round(terms["optimizer"] / GIB, 1)) == (0.6, 0.9)
    assert round(result.train.total_bytes / GIB) == 43 and round(result.kv_cache_tokens, -3) == 198_000
    assert round(result.peak_bytes / GIB) == round(result.rollout.total_bytes / GIB) == 55
    assert round((result.train.capacity_bytes - result.peak_bytes) / GIB) == 22
    assert round(result.switch.terms["merged LoRA weights"] / GIB) == 13
    # The full fine-tune on the same 2 GPUs does not fit (at TP2 it needs 4).
    assert not plan_memory(plan.with_layout(lora_rank=0)).fits
    assert not plan_memory(plan.with_layout(lora_rank=0, tp=2, sp=True, rollout_tp=2)).fits
    assert plan_memory(plan.with_layout(lora_rank=0, tp=2, sp=True, rollout_tp=2, world_size=4)).fits


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"lora_rank": -1}, r"lora_rank must be an integer >= 0, got -1"),
        ({"lora_rank": 4, "lora_targets": ("lm_head",)}, r"lora_targets=\['lm_head'\]: choose some of"),
        (
            {"lora_rank": 4, "arch": tiny_arch("qwen3_moe")},
            r"lora_targets: on a mixture-of-experts model LoRA adapts the attention only; gate_proj, up_proj, "
            r"down_proj would adapt the experts",
        ),
    ],
)
def test_bad_lora_plans_name_the_field(changes, expected) -> None:
    with pytest.raises(PlanError, match=expected):
        _plan(1, 1, True, tuple(TARGETS)).with_layout(**changes)
