"""LoRA settings: verl's keys with verl's defaults, and bad input refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.engine.lora_spec import TARGETS, LoRASpec

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DEMO = str(RECIPES / "demo_cpu.yaml")
MOE = str(RECIPES / "moe_demo_cpu.yaml")
DPO = str(RECIPES / "dpo_demo_cpu.yaml")
ADAPTER = ["sft.enable=false", "model.lora_rank=8", "model.lora_adapter_path=/x"]


def test_off_by_default_and_all_linear_resolves_to_every_projection() -> None:
    cfg = load_config(DEMO)
    assert cfg.model.lora_rank == 0 and cfg.model.lora_spec() is None
    spec = load_config(DEMO, ["model.lora_rank=8", "model.lora_alpha=32"]).model.lora_spec()
    assert spec == LoRASpec(rank=8, alpha=32.0, targets=tuple(TARGETS), dropout=0.0)
    assert spec.scale == 4.0
    some = load_config(DEMO, ["model.lora_rank=8", "model.target_modules=[self_attn.v_proj,q_proj]"])
    assert some.model.lora_spec().targets == ("q_proj", "v_proj")  # peft's module paths accepted, ordered


BAD = [
    (DEMO, ["model.lora_rank=-1"], r"model\.lora_rank=-1 must be >= 0"),
    (DEMO, ["model.lora_rank=8", "model.lora_alpha=0"], r"model\.lora_alpha=0(\.0)? must be > 0"),
    (DEMO, ["model.lora_rank=8", "model.lora_dropout=1.0"], r"model\.lora_dropout=1\.0 must be in \[0, 1\)"),
    (
        DEMO,
        ["model.lora_rank=8", "model.target_modules=[q_proj,qproj]"],
        r"model\.target_modules.*'qproj' matches",
    ),
    (
        DEMO,
        ["model.lora_rank=8", "model.target_modules=lm_head"],
        r"model\.target_modules.*'lm_head' matches no",
    ),
    (DEMO, ["model.target_modules=[]"], r"model\.target_modules=\[\]: no module is named"),
    (
        DEMO,
        ["model.lora_rank=8", "model.target_modules=[mlp.q_proj,self_attn.down_proj]"],
        r"model\.target_modules.*'mlp\.q_proj' is not q_proj of every layer \(write q_proj or self_attn\.q_proj\)",
    ),
    (
        DEMO,
        ["model.lora_rank=8", "model.target_modules=[layers.0.self_attn.q_proj]"],
        r"model\.target_modules.*'layers\.0\.self_attn\.q_proj' is not q_proj of every layer",
    ),
    (
        DEMO,
        [*ADAPTER, "algorithm.use_kl_loss=true"],
        r"model\.lora_adapter_path=/x with algorithm\.use_kl_loss=true: the KL reference .* base with the "
        r"adapters off.*mcore-rl convert mcore-to-hf --ckpt /x --merge-lora --base \S+ --out DIR.*turn the KL",
    ),
    (
        DPO,
        ADAPTER[1:],
        r"model\.lora_adapter_path=/x with a DPO reference model.*set dpo\.precompute_ref_log_probs=true",
    ),
    (DEMO, ["model.lora_adapter_path=/x"], r"model\.lora_adapter_path needs model\.lora_rank > 0"),
    (
        MOE,
        ["model.lora_rank=8"],  # all-linear
        r"model\.target_modules: on a mixture-of-experts model LoRA adapts the attention only; gate_proj, "
        r"up_proj, down_proj would adapt the experts.*set model\.target_modules=\[q_proj,k_proj,v_proj,o_proj\]",
    ),
    (MOE, ["model.lora_rank=8", "model.target_modules=[q_proj,mlp.down_proj]"], r"down_proj would adapt the"),
]


@pytest.mark.parametrize(("recipe", "overrides", "expected"), BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_bad_lora_settings_name_the_key(recipe: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(recipe, overrides)
    assert "\n" not in str(info.value)


def test_lora_on_a_mixture_of_experts_model_adapts_its_attention() -> None:
    cfg = load_config(MOE, ["model.lora_rank=8", "model.target_modules=[q_proj,v_proj,self_attn.o_proj]"])
    assert cfg.model.lora_spec().targets == ("q_proj", "v_proj", "o_proj")


def test_a_loaded_adapter_without_a_reference_model_is_accepted() -> None:
    load_config(DEMO, [*ADAPTER, "algorithm.use_kl_loss=false"])  # no KL term: no reference
    for off in ("dpo.precompute_ref_log_probs=true", "dpo.reference_free=true"):
        assert load_config(DPO, [*ADAPTER[1:], off]).model.lora_adapter_path == "/x"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"rank": 0}, r"model\.lora_rank=0 must be an integer > 0"),
        ({"alpha": -1.0}, r"model\.lora_alpha=-1\.0 must be > 0"),
        ({"targets": ()}, r"model\.target_modules=\[\]"),
    ],
)
def test_the_engine_spec_refuses_what_would_adapt_nothing(kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        LoRASpec(**{"rank": 4, "alpha": 8.0, "targets": ("q_proj",), **kwargs})
