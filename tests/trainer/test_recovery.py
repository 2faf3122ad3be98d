"""Recovery from a lost worker and a stop signal through Ray, in one run (``trainer.max_restarts``): a rank is
killed with SIGKILL during step 3, between the step-2 and step-4 checkpoints; the driver stops the groups,
starts them again, loads step 2's checkpoint and continues, and every RL step's numbers equal an uninterrupted
run's exactly (same seeds, CPU, fp32, 2 threads per rank). Then SIGTERM reaches the driver during step 4: the
step ends, its checkpoint is saved and the run stops (``Preempted``), so Ray's own native SIGTERM handler
(which killed the driver with a stack dump) no longer takes the signal."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mcore_rl.io.errors import Preempted
from mcore_rl.io.manifest import verify_manifest
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "trainer.total_training_steps=5",
    "trainer.save_freq=2",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
    "algorithm.ppo_mini_batch_size=2",
    "trainer.num_cpus=2",
]
TIMING = ("time/", "tokens_per_s", "memory/")


def _numbers(records: list[dict], last: int) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in records
        if r["stage"] == "rl" and r["step"] <= last
    ]


def test_a_worker_killed_between_checkpoints_is_recovered_exactly_and_sigterm_stops_with_a_checkpoint(
    tmp_path,
) -> None:
    import ray

    assert not ray.is_initialized()  # the run starts (and owns) its own Ray: 2 CPUs, 2 threads per rank
    data = str(tmp_path / "data")
    straight = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight, use_ray=False) as trainer:
        trainer.fit()
        expected = _numbers(trainer.records, 4)

    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={tmp_path / 'b'}"])
    killed: list[float] = []
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        (pid,) = trainer.actors.backend.group.run("pid")  # type: ignore[attr-defined]
        scorer_score = trainer.scorer.score  # the scorer outlives the groups a recovery replaces

        def faults(requests):
            if trainer.global_step == 3 and not killed:  # after step 2's checkpoint, before step 4's
                os.kill(pid, signal.SIGKILL)
                killed.append(time.time())
            if trainer.global_step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # to this driver: Ray's handler would end the process
            return scorer_score(requests)

        trainer.scorer.score = faults  # type: ignore[method-assign]
        with pytest.raises(Preempted, match="stopped by SIGTERM after step 4"):
            trainer.fit()
        got, records = _numbers(trainer.records, 4), trainer.records
        (recovery,) = trainer.recoveries
        assert ray.is_initialized()  # the run's Ray survived the restart ...
    assert not ray.is_initialized()  # ... and was stopped with the run's last workers
    assert killed and got == expected and [r["step"] for r in got] == [1, 2, 3, 4]
    assert (recovery.rank, recovery.failed_at_step, recovery.resumed_step, recovery.steps_lost) == (
        0,
        3,
        2,
        1,
    )
    verify_manifest(str(tmp_path / "b" / "checkpoints" / "global_step_4"))
    (record,) = [r for r in records if r["stage"] == "recovery"]
    fault_to_training = record["unix_time"] - killed[0]
    print(
        f"recovery: {record['phase']} lost at step 3, resumed from step 2: {recovery.seconds:.1f} s from the "
        f"fault noticed, {fault_to_training:.1f} s from the kill to training again"
    )
    assert 0 < recovery.seconds <= fault_to_training


PPO = [
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "critic.warmup_steps=1",
    "critic.optim.lr=1e-3",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


@pytest.mark.slow
@pytest.mark.sweep  # ~1 minute of Ray on 2 cores: `make test-sweep`; GRPO's recovery runs in make test
@pytest.mark.parametrize(
    "layout",
    [["trainer.n_gpus_per_node=2", "algorithm.ppo_micro_batch_size_per_gpu=4"], PPO],
    ids=["grpo-dp2-rank1-lost", "ppo-critic-colocated"],
)
def test_recovery_at_dp2_and_with_a_critic_equals_the_uninterrupted_run(tmp_path, layout) -> None:
    """A lost rank 1 of 2 (the group's other rank waited in a collective), and PPO's critic and adaptive KL
    controller restored with the actor: the recovered run's RL metrics equal the uninterrupted Ray run's."""
    data = str(tmp_path / "data")
    overrides = [*OVERRIDES, "trainer.total_training_steps=4", *layout]
    straight = tiny_run_config(data, [*overrides, f"trainer.default_local_dir={tmp_path / 'a'}"])
    with Trainer.from_config(straight, use_ray=True) as trainer:
        trainer.fit()
        expected = _numbers(trainer.records, 4)
    cfg = tiny_run_config(data, [*overrides, f"trainer.default_local_dir={tmp_path / 'b'}"])
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        pids = trainer.actors.backend.group.run("pid")  # type: ignore[attr-defined]
        scorer_score = trainer.scorer.score
        killed: list[int] = []

        def fault(requests):
            if trainer.global_step == 3 and not killed:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
            return scorer_score(requests)

        trainer.scorer.score = fault  # type: ignore[method-assign]
        trainer.fit()
        assert [(r.rank, r.resumed_step) for r in trainer.recoveries] == [(len(pids) - 1, 2)]
        assert _numbers(trainer.records, 4) == expected


def test_the_process_groups_collective_timeout_outlasts_the_watchdog() -> None:
    """A hang is named by the watchdog (phase, ranks, stacks), not ended first by the process group's timeout."""
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.trainer.build import collectives_outlast_the_watchdog

    default = ParallelConfig()
    assert default.timeout_minutes * 60 <= 1800  # the default phase limit would not come first on its own
    assert collectives_outlast_the_watchdog(default, 1800.0).timeout_minutes == 32
    assert collectives_outlast_the_watchdog(ParallelConfig(timeout_minutes=90), 1800.0).timeout_minutes == 90
    assert collectives_outlast_the_watchdog(default, None) is default


@pytest.mark.parametrize("mode", ["disable", "auto"])
def test_a_recovery_continues_from_this_runs_last_save_whatever_resume_mode_says(tmp_path, mode) -> None:
    """``trainer.resume_mode=disable`` names no checkpoint (and ``resume_path`` the run's start): after this run
    saved, a recovery must still continue from its last save, not start over."""
    overrides = [*OVERRIDES, "trainer.total_training_steps=3", f"trainer.resume_mode={mode}"]
    cfg = tiny_run_config(str(tmp_path / "data"), [*overrides, f"trainer.default_local_dir={tmp_path / 'r'}"])
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        assert trainer._recovery_point() is None  # nothing saved yet: a recovery starts the run over
        trainer.fit()  # saves at steps 2 and 3 (the last)
        point = trainer._recovery_point()
    assert point is not None and point.step == 3
    assert point.path == str(tmp_path / "r" / "checkpoints" / "global_step_3")


class _LostWorkerError(Exception):
    """What ``is_lost_worker`` recognises: a rank that died in a method."""

    kind, rank, method = "died", 0, "update"


def test_a_stop_asked_for_in_the_step_that_loses_a_worker_stops_at_the_checkpoint_resumed(tmp_path) -> None:
    """SIGTERM (a preemption notice) and a lost worker in the same step: the recovery loads step 2's checkpoint
    and the run stops there with it, instead of forgetting the stop and training on until the scheduler kills
    it."""
    overrides = [
        *OVERRIDES,
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.max_restarts=1",
    ]
    cfg = tiny_run_config(str(tmp_path / "data"), [*overrides, f"trainer.default_local_dir={tmp_path / 'r'}"])
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        scores = trainer.step.training_scores  # this step object's: a recovery builds a new one

        def preempted_and_lost(rollout, prompts):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                raise _LostWorkerError("rank 0 died")
            return scores(rollout, prompts)

        trainer.step.training_scores = preempted_and_lost  # type: ignore[method-assign]
        with pytest.raises(Preempted) as stopped:
            trainer.fit()
    assert stopped.value.step == 2 and stopped.value.signum == signal.SIGTERM
    assert stopped.value.checkpoint == str(tmp_path / "r" / "checkpoints" / "global_step_2")
    assert [r["step"] for r in trainer.records if r["stage"] == "rl"] == [1, 2]
