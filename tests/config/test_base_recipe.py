"""``recipes/base.yaml`` and the schema's defaults agree: a ``RunConfig`` built in Python runs like a recipe
that starts from ``defaults: [base]`` (one schema; base.yaml only shows the keys recipes usually change)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from mcore_rl.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "recipes" / "base.yaml"

MUST_DIFFER: dict[str, object] = {}
"""Keys base.yaml sets to something other than the schema's default (none today: add one here with the
reason, never silently)."""


def test_base_recipe_equals_the_schema_defaults() -> None:
    assert load_config(BASE, rules=False) == load_config(None, rules=False)


def test_every_key_of_base_is_a_schema_default() -> None:
    schema = OmegaConf.structured(RunConfig)

    def walk(node: dict, prefix: str = "") -> list[tuple[str, object, object]]:
        out = []
        for key, value in node.items():
            if isinstance(value, dict):
                out += walk(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" not in MUST_DIFFER and OmegaConf.select(schema, f"{prefix}{key}") != value:
                out.append((f"{prefix}{key}", value, OmegaConf.select(schema, f"{prefix}{key}")))
        return out

    raw = OmegaConf.to_container(OmegaConf.load(BASE))
    assert isinstance(raw, dict)
    assert walk(raw) == [], "base.yaml value vs the schema default"


def test_a_python_run_config_has_the_recipe_group_size() -> None:
    assert RunConfig().rollout.n == 8  # GRPO (the default estimator) needs n >= 2
