"""``trainer.one_step_off``: the next rollout is generated before the update, with the pre-update weights.

The same 3-step GRPO run (in-process, same seed) with the mode off and on. Off: on-policy, the rollout's
log-probs equal the trainer's (``token_mult_prob_error`` 1) and no ``policy_lag`` is logged. On: step 1 is
on-policy and its numbers equal the off run's; steps 2 and 3 train on rollouts one update old
(``policy_lag`` 1), which the recomputed old log-probs expose as a rollout/trainer mismatch.
"""

from __future__ import annotations

import itertools

import pytest

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, QUIET, rl_records, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    *QUIET,
    "trainer.total_training_steps=3",
    "data.train_batch_size=4",
    "optim.lr=1e-2",
]
SAME = ("reward", "response_len", "pg_loss", "entropy", "grad_norm", "token_mult_prob_error")


def _rl_records(tmp_path, name: str, extra: list[str]) -> list[dict]:
    return rl_records(str(tmp_path / "data"), tmp_path / name, [*OVERRIDES, *extra])


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
    # throughput pairs each rollout's tokens with its own sampling, the step before (the last step samples
    # nothing ahead: its 0 s made 6.5e10 tokens/s)
    sequences = on[0]["tokens_per_s"] * on[0]["time/generate_s"] / on[0]["response_len"]
    for before, record in itertools.pairwise(on):
        sampled_s = sequences * record["response_len"] / record["tokens_per_s"]
        assert sampled_s == pytest.approx(before["time/generate_next_s"], rel=0.2, abs=2e-3)
    for record in on[1:]:  # the old log-probs come from the updated actor, the samples from the one before
        assert record["token_mult_prob_error"] > 1.0 + 1e-3
    # lagged steps carry truncated importance weights of pi_old / pi_rollout; the on-policy first does not
    assert "rollout_is/mean" not in on[0]
    for record in on[1:]:
        assert 0.0 < record["rollout_is/mean"] <= 2.0 and record["rollout_is/max_raw"] > 0.0


def test_lagged_rollouts_are_importance_weighted_unless_switched_off(tmp_path) -> None:
    """The same one-step-off run with the correction on (default threshold 2) and off: identical until the first
    lagged step, whose samples (drawn before either update) are the same; only its weighted loss differs."""
    weighted = _rl_records(tmp_path, "w", ["trainer.one_step_off=true", "trainer.total_training_steps=2"])
    plain = _rl_records(
        tmp_path,
        "p",
        [
            "trainer.one_step_off=true",
            "trainer.total_training_steps=2",
            "algorithm.rollout_is_threshold=null",
        ],
    )
    assert all(not any(k.startswith("rollout_is/") for k in r) for r in plain)
    for key in SAME:
        assert weighted[0][key] == pytest.approx(plain[0][key], abs=1e-6), key
    assert weighted[1]["reward"] == pytest.approx(plain[1]["reward"], abs=1e-6)  # the same samples
    assert weighted[1]["token_mult_prob_error"] == pytest.approx(plain[1]["token_mult_prob_error"], abs=1e-6)
    assert weighted[1]["rollout_is/mean"] != pytest.approx(1.0, abs=1e-4)
    assert weighted[1]["pg_loss"] != pytest.approx(plain[1]["pg_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.sweep  # 29 s of CI: `make test-sweep`; the colocated one-step-off runs stay in `make test`
def test_a_rollout_pool_of_its_own_reproduces_the_colocated_one_step_off_run(tmp_path) -> None:
    """rollout.colocate=false on Ray: the next rollout samples on the pool while the actor updates, from the
    weights sent after the previous update; the numbers are the colocated in-process run's (same seeds, one
    replica), so the pool is sent the right weights at the right time."""
    extra = ["trainer.one_step_off=true", "trainer.num_cpus=2"]
    colocated = _rl_records(tmp_path, "colocated", extra)
    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'pool'}", *extra, "rollout.colocate=false"],
    )
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        pool = [r for r in trainer.records if r["stage"] == "rl"]
    assert [r["policy_lag"] for r in pool] == [0.0, 1.0, 1.0]
    assert "time/generate_wait_s" in pool[1] and "time/sync_send_s" in pool[0]
    for want, have in zip(colocated, pool, strict=True):
        for key in (*SAME, "rollout_is/mean"):
            if key in want:
                assert have[key] == pytest.approx(want[key], abs=1e-5), key
