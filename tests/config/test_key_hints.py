"""An unknown key says what it most likely meant: verl's name for our key, or the closest allowed key."""

from __future__ import annotations

import re

import pytest

from mcore_rl.config import ConfigError, RunConfig, load_config
from mcore_rl.config.key_hints import VERL_KEYS, schema_has

DEMO = "recipes/demo_cpu.yaml"


@pytest.mark.parametrize(
    ("verl", "ours"),
    [
        ("actor_rollout_ref.model.path", "model.path"),
        ("actor_rollout_ref.rollout.n", "rollout.n"),
        ("actor_rollout_ref.actor.optim.lr", "optim.lr"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "algorithm.ppo_mini_batch_size"),
        (
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
            "parallel.tensor_model_parallel_size",
        ),
        ("critic.model.path", "critic.model_path"),
        ("custom_reward_function.path", "reward.custom_function"),
    ],
)
def test_verl_keys_are_mapped_to_ours(verl: str, ours: str) -> None:
    with pytest.raises(ConfigError, match=rf"verl's {re.escape(verl)} is our {re.escape(ours)}$"):
        load_config(DEMO, [f"{verl}=1"])


def test_a_typo_gets_the_closest_key_and_nonsense_gets_none() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key rollout\.temprature .*did you mean rollout\.temperature\?"
    ):
        load_config(DEMO, ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO, ["zzz=1"])
    assert "did you mean" not in str(refused.value) and "verl's" not in str(refused.value)


def test_a_verl_key_with_no_counterpart_is_not_mapped() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO, ["actor_rollout_ref.actor.no_such_thing=1"])
    assert "verl's" not in str(refused.value)


def test_schema_walk() -> None:
    assert schema_has(RunConfig, "critic.parallel.tensor_model_parallel_size")  # an optional section
    assert schema_has(RunConfig, "rollout.val_kwargs.n") and not schema_has(RunConfig, "rollout.nope")
    assert not schema_has(RunConfig, "model.path.deeper")


def test_every_unknown_key_is_named_at_once_each_with_its_hint() -> None:
    """A verl command moved over named one unknown key per try (25 tries for a 37-key command)."""
    given = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.foo=1",
        "trainer.logger=[console,wandb]",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ]
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO, given)
    text = str(refused.value)
    assert text.startswith("5 keys refused:")
    assert "verl's actor_rollout_ref.rollout.n is our rollout.n" in text
    assert "verl's actor_rollout_ref.actor.optim.lr is our optim.lr" in text
    assert "unknown key trainer.foo (overrides); keys allowed under trainer: project_name," in text
    assert "our logging.wandb, logging.tensorboard and logging.mlflow" in text
    assert "model.recompute=full" in text


def test_a_recipes_unknown_keys_and_the_overrides_are_named_together(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults: [demo_cpu]\nrollout:\n  nn: 2\n")
    with pytest.raises(
        ConfigError, match=rf"(?s)2 keys refused:.*rollout\.nn \({recipe}\).*trainer\.foo \(overrides\)"
    ):
        load_config(recipe, ["trainer.foo=1"])


def test_verl_key_hints_name_keys_that_exist() -> None:
    for verl, text in VERL_KEYS.items():
        text = text.replace(verl, "")
        named = re.findall(  # the keys of ours it names (not verl's own, which it repeats)
            r"\b((?:model|rollout|algorithm|optim|data|reward|trainer|logging|critic)\.[\w.]*\w)", text
        )
        assert named, verl
        for key in named:
            assert schema_has(RunConfig, key.split("=")[0]), (verl, key)


def test_hydra_add_and_force_add_overrides_set_the_key() -> None:
    cfg = load_config(DEMO, ["+rollout.n=8", "++trainer.val_before_train=false"])
    assert cfg.rollout.n == 8 and cfg.trainer.val_before_train is False
    with pytest.raises(ConfigError, match=r"unknown key trainer\.val_only"):
        load_config(DEMO, ["+trainer.val_only=true"])  # added or not, the key must be ours
    with pytest.raises(ConfigError, match=r"'~trainer\.seed': a key cannot be removed"):
        load_config(DEMO, ["~trainer.seed"])
