"""An unknown key says what it most likely meant: verl's name for our key, or the closest allowed key."""

from __future__ import annotations

import pytest

from mcore_rl.config import ConfigError, RunConfig, load_config
from mcore_rl.config.key_hints import schema_has

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
    with pytest.raises(ConfigError, match=rf"verl's {verl} is our {ours};"):
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
