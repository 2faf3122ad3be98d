"""Recovery from a lost worker through Ray (``trainer.max_restarts``): a rank killed with SIGKILL between two
run checkpoints; the driver stops the groups, starts them again, loads the last checkpoint and continues, and
every RL step's numbers equal an uninterrupted run's exactly (same seeds, CPU, fp32, 2 threads per rank)."""

from __future__ import annotations

import os
import signal
import time

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "trainer.total_training_steps=4",
    "trainer.save_freq=2",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
    "algorithm.ppo_mini_batch_size=2",
    "trainer.num_cpus=2",
]
TIMING = ("time/", "tokens_per_s", "memory/")


def _numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records if r["stage"] == "rl"]


def test_a_worker_killed_between_checkpoints_is_recovered_and_the_run_equals_the_uninterrupted_one(
    tmp_path,
) -> None:
    import ray

    assert not ray.is_initialized()  # the run starts (and owns) its own Ray: 2 CPUs, 2 threads per rank
    data = str(tmp_path / "data")
    straight = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight, use_ray=False) as trainer:
        trainer.fit()
        expected = _numbers(trainer.records)

    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'b'}"])
    killed: list[float] = []
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        (pid,) = trainer.actors.backend.group.run("pid")  # type: ignore[attr-defined]
        scores = trainer.step.training_scores

        def kill_during_step_3(rollout, prompts):
            if trainer.global_step == 3:  # after step 2's checkpoint, before step 4's
                os.kill(pid, signal.SIGKILL)
                killed.append(time.time())
            return scores(rollout, prompts)

        trainer.step.training_scores = kill_during_step_3  # this step object only: the rebuilt one is new
        trainer.fit()
        got, records = _numbers(trainer.records), trainer.records
        (recovery,) = trainer.recoveries
        assert ray.is_initialized()  # the run's Ray survived the restart ...
    assert not ray.is_initialized()  # ... and was stopped with the run's last workers
    assert killed and got == expected
    assert (recovery.rank, recovery.failed_at_step, recovery.resumed_step, recovery.steps_lost) == (
        0,
        3,
        2,
        1,
    )
    (record,) = [r for r in records if r["stage"] == "recovery"]
    fault_to_training = record["unix_time"] - killed[0]
    print(
        f"recovery: {record['phase']} lost at step 3, resumed from step 2: {recovery.seconds:.1f} s from the "
        f"fault noticed, {fault_to_training:.1f} s from the kill to training again"
    )
    assert 0 < recovery.seconds <= fault_to_training
