"""PPO through the driver with context parallelism: two Ray ranks splitting every sequence (CP2), the actor's
log-probs, the critic's values and both updates on CP shards, the rollout synced from the CP ranks' (identical)
weights every step.

``token_mult_prob_error`` (the rollout engine's token probabilities against the trainer's) stays within 1e-3
of 1 in fp32 on every step, and the run's metrics equal a CP1 run of the same config (DP2) within fp32
rounding: context parallelism changes how the tokens are split, not what is computed."""

from __future__ import annotations

import pytest

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, QUIET, tiny_run_config

OVERRIDES = [
    *QUIET,
    MIXED_REWARD,
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=2",
    "algorithm.adv_estimator=gae",
    "critic.optim.lr=1e-3",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "model.use_remove_padding=true",
    "data.train_batch_size=4",
]
COMPARED = ("reward", "pg_loss", "entropy", "grad_norm", "critic/values_mean", "critic/vf_loss", "kl_loss")


def _records(folder: str, cp: int) -> list[dict]:
    cfg = tiny_run_config(folder, [*OVERRIDES, f"parallel.context_parallel_size={cp}"])
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        return [r for r in trainer.records if r["stage"] == "rl" and r["step"] > 0]


@pytest.mark.usefixtures("ray_session")
def test_ppo_at_cp2_keeps_rollout_and_trainer_in_agreement(tmp_path) -> None:
    records = _records(str(tmp_path), 2)
    assert len(records) == 2
    for r in records:
        assert 0.999 <= r["token_mult_prob_error"] <= 1.001, r
        assert r["grad_norm"] > 0 and r["critic/vf_loss"] > 0


@pytest.mark.sweep
@pytest.mark.usefixtures("ray_session")
def test_ppo_at_cp2_equals_cp1(tmp_path) -> None:
    cp2, cp1 = _records(str(tmp_path / "cp2"), 2), _records(str(tmp_path / "cp1"), 1)
    for a, b in zip(cp1, cp2, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], abs=1e-4, rel=1e-4), key
