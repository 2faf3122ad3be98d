"""PPO run checkpoints (CPU, fp32, in-process): 4 steps straight == 2 steps, interrupted, resumed, 2 more, in
every metric (critic and adaptive in-reward KL coefficient included) and every actor and critic weight.
The run checkpoint holds the critic's own checkpoint (weights, Adam state, LR schedule) and the controller."""

from __future__ import annotations

import json
import os

import torch

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.1",
    "algorithm.kl_ctrl.target_kl=0.001",
    "algorithm.kl_ctrl.horizon=16",
    "critic.warmup_steps=1",
    "critic.optim.lr=1e-3",
    "critic.optim.lr_decay_style=linear",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "trainer.total_training_steps=4",
    "trainer.save_freq=2",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
    "algorithm.ppo_mini_batch_size=2",
]
TIMING = ("time/", "tokens_per_s", "memory/")  # wall-clock and RSS differ between runs


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    worker = trainer.actors.backend.worker  # type: ignore[attr-defined]
    models = {"actor": worker.engine.models[0], "critic": worker.critic.engine.models[0]}
    return {f"{role}.{n}": p.detach().clone() for role, m in models.items() for n, p in m.named_parameters()}


def _rl_metrics(trainer: Trainer, steps: set[int]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in trainer.records
        if r["stage"] == "rl" and r["step"] in steps
    ]


def test_ppo_resume_restores_critic_and_kl_controller_exactly(tmp_path) -> None:
    data = str(tmp_path / "data")
    straight_cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight_cfg, use_ray=False) as straight:
        straight.fit()
        expected, expected_weights = _rl_metrics(straight, {3, 4}), _weights(straight)
    coefs = [r["kl_in_reward/coef"] for r in straight.records if r["stage"] == "rl"]
    assert len(set(coefs)) == 4  # the adaptive controller moved every step: its state matters

    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'b'}"])
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=2)
    checkpoint = os.path.join(first.checkpoint_root, "global_step_2")
    assert os.path.isfile(os.path.join(checkpoint, "critic", "trainer_state.json"))
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        assert json.load(f)["extra"]["algorithm"]["kl_ctrl"]["type"] == "adaptive"
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        resumed.fit()
        assert _rl_metrics(resumed, {3, 4}) == expected
        weights = _weights(resumed)
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[n], w) for n, w in expected_weights.items())
