"""Context-parallel settings are checked before anything starts, each problem naming its keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DENSE = str(RECIPES / "demo_cpu.yaml")
MOE = str(RECIPES / "moe_demo_cpu.yaml")
TWO = ["trainer.n_gpus_per_node=2"]

BAD = [
    (
        DENSE,
        [*TWO, "parallel.context_parallel_size=4"],
        "context_parallel_size = 1 * 1 * 4 = 4 does not divide the world size 2",
    ),
    (
        DENSE,
        [
            "trainer.n_gpus_per_node=4",
            "parallel.tensor_model_parallel_size=2",
            "parallel.context_parallel_size=4",
        ],
        "context_parallel_size = 2 * 1 * 4 = 8 does not divide the world size 4",
    ),
    (DENSE, [*TWO, "parallel.context_parallel_size=0"], "parallel.context_parallel_size"),
    (
        DENSE,
        [*TWO, "parallel.context_parallel_size=2", "model.share_prompt_prefix=true"],
        "model.share_prompt_prefix=true with parallel.context_parallel_size=2",
    ),
    (
        DENSE,
        [*TWO, "parallel.context_parallel_size=2", "parallel.data_parallel_size=2"],
        "parallel.data_parallel_size=2 but world size 2 / (TP*PP*CP=2) gives 1",
    ),
    (
        MOE,
        ["parallel.expert_model_parallel_size=1", "parallel.context_parallel_size=2"],
        "context_parallel_size=2 with a mixture-of-experts model (num_experts=4) is not supported",
    ),
]


@pytest.mark.parametrize(("recipe", "overrides", "expected"), BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_bad_context_parallel_settings_name_the_key(recipe: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    assert expected in str(info.value)


def test_cp2_on_two_ranks_is_one_data_parallel_shard() -> None:
    cfg = load_config(DENSE, [*TWO, "parallel.context_parallel_size=2", "model.use_remove_padding=true"])
    layout = cfg.parallel.layout(cfg.world_size)
    assert (layout.cp, layout.dp, layout.sequence_multiple) == (2, 1, 4)
