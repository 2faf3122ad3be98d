"""Run checkpoints (CPU, fp32, in-process): 4 steps straight == 2 steps, interrupted, resumed, 2 more steps,
in every metric and every weight; a resume with a changed model is refused, naming what changed."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "trainer.total_training_steps=4",
    "trainer.save_freq=2",
    "trainer.max_ckpt_to_keep=1",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "optim.lr_decay_style=linear",
    "optim.lr_warmup_steps=1",
    "data.train_batch_size=4",
    "algorithm.ppo_mini_batch_size=2",
]
TIMING = ("time/", "tokens_per_s", "memory/")  # wall-clock and RSS differ between runs


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    engine = trainer.actors.backend.worker.engine  # type: ignore[attr-defined]
    return {n: p.detach().clone() for n, p in engine.models[0].named_parameters()}


def _rl_metrics(trainer: Trainer, steps: set[int]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in trainer.records
        if r["stage"] == "rl" and r["step"] in steps
    ]


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path) -> None:
    data = str(tmp_path / "data")
    straight_cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight_cfg, use_ray=False) as straight:
        straight.fit()
        expected, expected_weights = _rl_metrics(straight, {3, 4}), _weights(straight)

    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'b'}"])
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=2)  # the "kill": nothing after step 2's checkpoint survives
    with open(os.path.join(first.checkpoint_root, "latest")) as latest:
        assert latest.read().strip() == "global_step_2"
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        resumed.fit()
        assert _rl_metrics(resumed, {3, 4}) == expected
        weights = _weights(resumed)
    assert all(torch.equal(weights[n], w) for n, w in expected_weights.items())
    assert sorted(os.listdir(resumed.checkpoint_root)) == ["global_step_4", "latest"]  # keep the last 1

    changed = tiny_run_config(
        data,
        [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'b'}", "model.hf_config.intermediate_size=128"],
    )
    with pytest.raises(ValueError, match="intermediate_size"):  # refused before any worker starts
        Trainer.from_config(changed, use_ray=False)


def test_one_step_off_resume_trains_on_the_checkpointed_pending_rollout(tmp_path) -> None:
    """The rollout generated ahead at step 2 (before step 2's update) is in step 2's checkpoint: the resumed
    run's steps 3 and 4 equal the uninterrupted run's, lag and importance weights included."""
    data, extra = str(tmp_path / "data"), ["trainer.one_step_off=true"]
    straight_cfg = tiny_run_config(data, [*OVERRIDES, *extra, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight_cfg, use_ray=False) as straight:
        straight.fit()
        expected = _rl_metrics(straight, {3, 4})
    cfg = tiny_run_config(data, [*OVERRIDES, *extra, f"trainer.default_local_dir={tmp_path / 'b'}"])
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=2)
    assert os.path.isfile(os.path.join(first.checkpoint_root, "global_step_2", "pending_rollout.safetensors"))
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        resumed.fit()
        got = _rl_metrics(resumed, {3, 4})
        throughput = [r.get("tokens_per_s") for r in resumed.records if r["stage"] == "rl"]
    assert [r["policy_lag"] for r in got] == [1.0, 1.0] and "rollout_is/mean" in got[0]
    # the restored rollout was sampled before the checkpoint, in another process: its rate is not known
    assert throughput[0] is None and 0 < throughput[1] < 1e7
    assert got == expected
