"""``reward.overlong_buffer``: DAPO's soft overlong punishment, the pure ramp and through a GRPO step (the
training reward falls by the penalty of each response's length; validation reads the rules alone)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.scoring.shaping import overlong_penalty
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config


def test_the_ramp_is_dapos() -> None:
    # budget 20, buffer 8: no penalty up to 12 tokens, then -1/8 per token (factor 1), -1 at 20
    lengths = torch.tensor([0, 12, 13, 16, 20])
    assert overlong_penalty(lengths, 20, 8, 1.0).tolist() == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 8, 0.5).tolist() == [0.0, 0.0, -0.0625, -0.25, -0.5]
    with pytest.raises(ValueError, match="must be in"):
        overlong_penalty(lengths, 20, 20, 1.0)


def test_a_step_subtracts_the_penalty_of_each_response(tmp_path) -> None:
    data = str(tmp_path / "data")
    base = [MIXED_REWARD, "trainer.total_training_steps=1", "trainer.test_freq=-1"]
    runs = {}
    for name, extra in (("plain", []), ("shaped", ["reward.overlong_buffer.enable=true"])):
        budget = tiny_run_config(data, base).rollout.response_length
        shaping = [f"reward.overlong_buffer.len={budget // 2}", "reward.overlong_buffer.penalty_factor=2.0"]
        cfg = tiny_run_config(data, [*base, *extra, *shaping, f"trainer.default_local_dir={tmp_path / name}"])
        with Trainer.from_config(cfg, use_ray=False) as trainer:
            trainer.fit()
            runs[name] = next(r for r in trainer.records if r["stage"] == "rl" and "reward" in r)
    plain, shaped = runs["plain"], runs["shaped"]
    assert "reward/overlong_penalty" not in plain
    assert shaped["reward/overlong_frac"] > 0  # the random model runs into the budget's second half
    # the same rollout (same seed and weights): the reward moved by the mean penalty, nothing else
    assert shaped["response_len"] == plain["response_len"]
    assert shaped["reward"] == pytest.approx(plain["reward"] + shaped["reward/overlong_penalty"], abs=1e-6)
    with pytest.raises(
        ConfigError, match=r"reward\.overlong_buffer\.len=.* must be below rollout\.response_length"
    ):
        tiny_run_config(
            data, [*base, "reward.overlong_buffer.enable=true", f"reward.overlong_buffer.len={budget}"]
        )
    with pytest.raises(
        ConfigError, match=r"reward_model\.overlong_buffer\.enable.*reward\.overlong_buffer\.enable"
    ):
        load_config("recipes/demo_cpu.yaml", ["reward_model.overlong_buffer.enable=true"])  # verl's key
