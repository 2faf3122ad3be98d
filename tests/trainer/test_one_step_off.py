"""``trainer.one_step_off``: the next rollout is generated before the update, with the pre-update weights.

The same 3-step GRPO run (in-process, same seed) with the mode off and on. Off: on-policy, the rollout's
log-probs equal the trainer's (``token_mult_prob_error`` 1) and no ``policy_lag`` is logged. On: step 1 is
on-policy and its numbers equal the off run's; steps 2 and 3 train on rollouts one update old
(``policy_lag`` 1), which the recomputed old log-probs expose as a rollout/trainer mismatch.
"""

from __future__ import annotations

import pytest

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "trainer.total_training_steps=3",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
    "optim.lr=1e-2",
]
SAME = ("reward", "response_len", "pg_loss", "entropy", "grad_norm", "token_mult_prob_error")


def _rl_records(tmp_path, name: str, extra: list[str]) -> list[dict]:
    cfg = tiny_run_config(
        str(tmp_path / "data"), [*OVERRIDES, f"trainer.default_local_dir={tmp_path / name}", *extra]
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        trainer.fit()
        return [r for r in trainer.records if r["stage"] == "rl"]


def test_one_step_off_trains_on_the_rollout_generated_before_the_last_update(tmp_path) -> None:
    off = _rl_records(tmp_path, "off", [])
    on = _rl_records(tmp_path, "on", ["trainer.one_step_off=true"])
    assert len(off) == len(on) == 3
    assert all("policy_lag" not in r for r in off)
    assert all(r["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4) for r in off)
    assert [r["policy_lag"] for r in on] == [0.0, 1.0, 1.0]
    for key in SAME:  # before any update both runs are the same on-policy step
        assert on[0][key] == pytest.approx(off[0][key], abs=1e-6), key
    assert "time/generate_next_s" in on[0] and "time/generate_s" not in on[1]
    for record in on[1:]:  # the old log-probs come from the updated actor, the samples from the one before
        assert record["token_mult_prob_error"] > 1.0 + 1e-3
