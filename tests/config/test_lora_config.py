"""LoRA settings: verl's keys with verl's defaults, and bad input refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.engine.lora_spec import TARGETS, LoRASpec

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DEMO = str(RECIPES / "demo_cpu.yaml")
MOE = str(RECIPES / "moe_demo_cpu.yaml")


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
    (DEMO, ["model.lora_adapter_path=/x"], r"model\.lora_adapter_path needs model\.lora_rank > 0"),
    (MOE, ["model.lora_rank=8"], r"model\.lora_rank=8: LoRA on mixture-of-experts models is not supported"),
]


@pytest.mark.parametrize(("recipe", "overrides", "expected"), BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_bad_lora_settings_name_the_key(recipe: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(recipe, overrides)
    assert "\n" not in str(info.value)


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
