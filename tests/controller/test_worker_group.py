"""Worker groups on a real local Ray: collectives across 2 and 4 ranks, dispatch by DP rank, and faults
(an exception on one rank, kill -9 of one actor) that end the call within seconds with the rank named."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from mcore_rl.controller import WorkerError, WorkerGroup, data_owners
from mcore_rl.engine.workers.base import Worker
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext

pytestmark = pytest.mark.usefixtures("ray_session")


def _sum_of_ranks(ctx: ParallelContext) -> tuple[int, int]:
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    tp_value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(tp_value, group=ctx.tp_group)
    return int(value.item()), int(tp_value.item())


class _ShardSumWorker(Worker):
    def shard_sum(self, shard: torch.Tensor, scale: float) -> float | None:
        """Each DP replica sums its shard; only the owner (last stage, TP rank 0) reports."""
        return scale * float(shard.sum()) if self.ctx.is_last_stage and self.ctx.tp_rank == 0 else None


def _niceness(ctx: ParallelContext) -> int:
    return os.nice(0)


def _fail_on_rank_1(ctx: ParallelContext) -> None:
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here for the 30-minute collective timeout


def _wait_in_collective(ctx: ParallelContext) -> None:
    time.sleep(0.5)
    dist.barrier()


def test_four_ranks_tp2_dp2_run_collectives_and_dp_dispatch() -> None:
    with WorkerGroup.spawn(_ShardSumWorker, 4, ParallelConfig(tensor_model_parallel_size=2)) as group:
        assert [(i.tp_rank, i.dp_rank) for i in group.infos] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert group.run("run", _sum_of_ranks) == [(10, 1), (10, 1), (10, 5), (10, 5)]
        # The ranks run at the driver's priority, not Ray's default worker niceness of 15.
        assert group.run("run", _niceness) == [os.nice(0)] * 4
        shards = [torch.ones(3), torch.full((3,), 2.0)]
        results = group.get(group.call_sharded("shard_sum", shards, "dp", 10.0))
        assert [results[i] for i in data_owners(group.infos)] == [30.0, 60.0]
        assert results[1] is None and results[3] is None


_KEPT_UNTIL_EXIT: list[tempfile.TemporaryDirectory] = []


def _folder_kept_until_exit(ctx: ParallelContext) -> str:
    """What a library does at import (wandb's media folder): a temporary folder removed when Python exits."""
    _KEPT_UNTIL_EXIT.append(tempfile.TemporaryDirectory(prefix="mcore_rl_test_exit_"))
    return _KEPT_UNTIL_EXIT[-1].name


def test_a_group_ends_its_processes_as_python_exits_so_their_exit_handlers_run() -> None:
    with WorkerGroup.spawn(Worker, 2) as group:
        folders = group.run("run", _folder_kept_until_exit)
        assert all(os.path.isdir(f) for f in folders)
    # ray.kill alone leaves them behind: one per rank per run
    assert not any(os.path.exists(f) for f in folders)


def test_exception_on_one_rank_ends_the_call_fast_with_its_rank_and_traceback() -> None:
    import ray

    group = WorkerGroup.spawn(Worker, 2)
    assert group.run("run", _sum_of_ranks) == [(3, 0), (3, 1)]
    # three phases of 1.8 s queued on the same ranks, awaited last first (as PPO awaits the actor's update queued
    # behind the critic's): each is within its 2 s, so no hang, though the last ends 5.4 s after it was sent
    queued = [group.call("run", _a_phase_of_1_8_s) for _ in range(3)]
    assert [group.get(p) for p in reversed(queued)] == [[0, 1]] * 3
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed in run") as info:
        group.run("run", _fail_on_rank_1)
    assert time.monotonic() - start < 15
    assert "boom on purpose" in str(info.value) and "_fail_on_rank_1" in str(info.value)
    _assert_cleaned_up(ray, group)


def _nonfinite_on_every_rank(ctx: ParallelContext) -> None:
    from mcore_rl.engine.train_engine import NonFiniteLossError

    raise NonFiniteLossError(f"rank {ctx.rank}: NaN/inf loss [nan]; the update was not applied")


def test_a_typed_error_crosses_the_ray_boundary_as_itself() -> None:
    """The driver tells a NaN loss from other failures by type (``WorkerError.cause``), not by its message;
    the RL step then names the step (``trainer/step.py``)."""
    from mcore_rl.engine.train_engine import NonFiniteLossError
    from mcore_rl.trainer.step import named_nonfinite

    # the group's placement group is released for the next test
    with WorkerGroup.spawn(Worker, 1) as group, pytest.raises(WorkerError) as info:
        group.run("run", _nonfinite_on_every_rank)
    assert isinstance(info.value.cause, NonFiniteLossError) and info.value.rank == 0

    def failed_update() -> None:
        raise info.value

    with pytest.raises(
        NonFiniteLossError, match=r"^step 7: NaN/inf loss or gradient, the update was not applied"
    ):
        named_nonfinite(7, failed_update)

    def other_failure() -> None:
        raise WorkerError(0, "update", "ValueError: unrelated", ValueError("unrelated NaN/inf loss text"))

    with pytest.raises(WorkerError, match="unrelated"):  # not a NaN loss, whatever its message says
        named_nonfinite(7, other_failure)


def test_kill_9_of_one_actor_ends_the_call_fast_with_its_rank() -> None:
    import ray

    group = WorkerGroup.spawn(Worker, 2)
    pids = group.run("pid")
    refs = group.call("run", _wait_in_collective)
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0 failed in run: its process died") as info:
        group.get(refs)
    assert time.monotonic() - start < 15
    assert info.value.died  # what the driver recovers from (a raised error is not: test above)
    _assert_cleaned_up(ray, group)


def _a_phase_of_1_8_s(ctx: ParallelContext) -> int:
    time.sleep(1.8)
    return ctx.rank


def _stuck_on_rank_1(ctx: ParallelContext) -> int:
    if ctx.rank == 1:
        time.sleep(120)
    return ctx.rank


def test_a_hung_phase_fails_within_seconds_naming_it_the_ranks_and_where_they_are(
    tmp_path, monkeypatch
) -> None:
    """``trainer.phase_timeout_s`` through Ray: a fast phase is untouched; a rank stuck in one dumps its stack
    into the stacks folder and the call fails at the timeout (plus the watchdog's grace), not after the
    collective's 30 minutes."""
    import ray

    from mcore_rl.controller import watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 2.0)  # the driver's wait past the ranks' dump (5 s in a run)
    stacks = str(tmp_path / "stacks")
    group = WorkerGroup.spawn(Worker, 2, phase_timeout_s=2.0, stacks_dir=stacks)
    assert group.run("run", _sum_of_ranks) == [(3, 0), (3, 1)]
    # three phases of 1.8 s queued on the same ranks, awaited last first (as PPO awaits the actor's update queued
    # behind the critic's): each is within its 2 s, so no hang, though the last ends 5.4 s after it was sent
    queued = [group.call("run", _a_phase_of_1_8_s) for _ in range(3)]
    assert [group.get(p) for p in reversed(queued)] == [[0, 1]] * 3
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.run("run", _stuck_on_rank_1)
    elapsed = time.monotonic() - start
    assert info.value.kind == WorkerError.HUNG and not info.value.died
    message = str(info.value)
    assert message.startswith(
        "phase 'run' made no progress for 2 s (trainer.phase_timeout_s): ranks [1] did not finish (ranks [0] "
        "did): rank 1 in _stuck_on_rank_1 (test_worker_group.py:"
    ), message
    assert message.endswith(f"Python stacks in {stacks}")
    assert 2.0 < elapsed < 2.0 + 2.0 + 5, elapsed
    with open(os.path.join(stacks, "Worker_rank1.txt")) as f:
        assert "in _stuck_on_rank_1" in f.read()
    # rank 0 finished its phase: nothing dumped, and the group's shutdown left no file of it
    assert not os.path.exists(os.path.join(stacks, "Worker_rank0.txt"))
    _assert_cleaned_up(ray, group)


def _assert_cleaned_up(ray, group: WorkerGroup) -> None:
    """Every actor is dead (a call on it raises) and the pool's placement group is removed."""
    from ray.exceptions import RayActorError
    from ray.util.placement_group import placement_group_table

    for actor in group.actors:
        with pytest.raises(RayActorError):
            ray.get(actor.pid.remote(), timeout=10)
    assert placement_group_table(group.pool.placement_group)["state"] == "REMOVED"
