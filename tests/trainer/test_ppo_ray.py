"""A critic on its own Ray pool (2 ranks, TP2, its own layout) beside a 1-rank actor: the same numbers as
the colocated in-process critic (values to 1e-5), the critic started from the actor through the driver,
and its checkpoint inside the run checkpoint; with ``trainer.overlap_stages`` off (values, log-probs and
scoring one after another, then the critic's update before the actor's) every metric is identical to the
overlapped run."""

from __future__ import annotations

import os

import pytest

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "algorithm.adv_estimator=gae",
    "critic.warmup_steps=1",
    "critic.optim.lr=1e-3",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "trainer.total_training_steps=2",
    "trainer.save_freq=2",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
]
COMPARED = (
    "reward",
    "response_len",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/vf_loss",
    "pg_loss",
)


def _rl(trainer: Trainer) -> list[dict]:
    return [r for r in trainer.records if r["stage"] == "rl"]


def separate_overrides(run_dir: object) -> list[str]:
    return [
        *OVERRIDES,
        f"trainer.default_local_dir={run_dir}",
        "critic.colocate=false",
        "critic.num_ranks=2",
        "critic.parallel.tensor_model_parallel_size=2",
    ]


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "tokens_per_s", "memory/"))}


@pytest.mark.slow
@pytest.mark.sweep  # 54 s: `make test-sweep` (CI time); the colocated critic runs stay in `make test`
def test_critic_on_its_own_pool_matches_the_colocated_critic(tmp_path) -> None:
    data = str(tmp_path / "data")
    colocated = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(colocated, use_ray=False) as trainer:
        trainer.fit()
        expected = _rl(trainer)
    separate = tiny_run_config(data, separate_overrides(tmp_path / "b"))
    with Trainer.from_config(separate, use_ray=True) as trainer:
        trainer.fit()
        got = _rl(trainer)
        checkpoint = os.path.join(trainer.checkpoint_root, "global_step_2")
    sequential = tiny_run_config(data, [*separate_overrides(tmp_path / "c"), "trainer.overlap_stages=false"])
    with Trainer.from_config(sequential, use_ray=True) as trainer:
        trainer.fit()
        one_by_one = _rl(trainer)
    # Overlap changes no number: every metric but wall time and memory is identical.
    assert [_numbers(r) for r in one_by_one] == [_numbers(r) for r in got]
    assert "time/values_s" in one_by_one[0] and "time/values_s" not in got[0]
    assert os.path.isfile(os.path.join(checkpoint, "critic", "trainer_state.json"))
    assert [r["actor_frozen"] for r in got] == [1.0, 0.0]
    for want, have in zip(expected, got, strict=True):
        for key in COMPARED:
            assert have[key] == pytest.approx(want[key], abs=1e-5), key
