"""The host all-reduce (mcore_rl/parallel/host_reduce.py): sums equal to gloo's, in pieces and across layouts,
nothing left in /dev/shm, gloo kept where shared memory cannot hold, and a dead peer named, not waited for."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_rl.ops._native import extension_loaded
from mcore_rl.parallel import host_reduce
from mcore_rl.parallel.host_reduce import HostReduce
from mcore_rl.parallel.launch_env import free_local_port

pytestmark = pytest.mark.skipif(not extension_loaded(), reason="the barrier is in the native extension")


def _grads(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    return torch.randn(numel, generator=generator).to(dtype)


def _sums(slot_bytes: int) -> dict:
    """Several buffers through one reducer (lengths that split unevenly, pieces of several slots, a short last
    piece, two dtypes, the average) against gloo's all-reduce and a float64 sum."""
    reducer = HostReduce.open(None, slot_bytes)
    assert reducer is not None
    dist.barrier()  # rank 0 unlinks the name once all have mapped it, as it leaves open()
    ours_prefix = f"mcore_rl-grads-{reducer.pids[0]}-"
    leftovers = [n for n in os.listdir(host_reduce.SHM_DIR) if n.startswith(ours_prefix)]
    results = {"leftovers": leftovers, "pieces": 0}
    for seed, (numel, dtype, average) in enumerate(
        [
            (1000, torch.float32, False),
            (37, torch.float32, False),
            (4099, torch.float32, True),
            (515, torch.bfloat16, False),
        ]
    ):
        mine = _grads(numel, dtype, seed)
        ours = mine.clone()
        reducer.all_reduce_(ours, average=average)
        theirs = mine.clone()
        dist.all_reduce(theirs)
        if average:
            theirs /= dist.get_world_size()
        exact = mine.double()
        dist.all_reduce(exact)
        if average:
            exact /= dist.get_world_size()
        results[seed] = (ours, theirs, exact)
        results["pieces"] += -(-numel * mine.element_size() // reducer.slot_bytes)
    reducer.close()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_sums_match_gloo_on_every_rank(run_distributed, world_size):
    results = run_distributed(_sums, 256, world_size=world_size)
    assert results[0]["pieces"] > 4 * 4  # several pieces per buffer, not one
    for rank_result in results:
        assert rank_result["leftovers"] == []  # unlinked once every rank had mapped it
    for case in range(4):
        ours = [r[case][0] for r in results]
        for other in ours[1:]:
            assert torch.equal(other, ours[0])  # every rank holds the very same sum
        theirs, exact = results[0][case][1], results[0][case][2]
        tolerance = 1e-2 if ours[0].dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(ours[0].double(), exact, rtol=tolerance, atol=tolerance)
        if world_size == 2:  # two addends: a + b == b + a, so gloo's sum bit for bit
            assert torch.equal(ours[0], theirs)


def _open_with(rank_patches: dict[int, dict]) -> bool:
    """HostReduce.open with this rank's module attributes patched (restored after); whether it opened."""
    patches = rank_patches.get(dist.get_rank(), {})
    saved = {name: getattr(host_reduce, name) for name in patches}
    try:
        for name, value in patches.items():
            setattr(host_reduce, name, value)
        reducer = HostReduce.open(None, 4096)
    finally:
        for name, value in saved.items():
            setattr(host_reduce, name, value)
    if reducer is None:
        return False
    reducer.close()
    return True


def _other_namespace() -> str:
    return "pid:[0]"


def _no_barrier() -> None:
    return None


@pytest.mark.parametrize(
    "rank_patches",
    [
        {0: {"SHM_DIR": "/nonexistent-shm-dir"}},  # no /dev/shm: rank 0 cannot create the file
        {1: {"_pid_namespace": _other_namespace}},  # a peer in another pid namespace: its death unseen
        {1: {"_native_barrier": _no_barrier}},  # a rank without the native barrier
    ],
    ids=["no-shm", "pid-namespace", "no-native"],
)
def test_every_rank_keeps_gloo_when_one_cannot_share(run_distributed, rank_patches):
    assert run_distributed(_open_with, rank_patches) == [False, False]


def test_one_rank_keeps_gloo(run_distributed):
    assert run_distributed(_open_with, {}, world_size=1) == [False]


def _dying_peer(rank: int, port: int, outcome: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    reducer = HostReduce.open(None, 1024)
    if rank == 1:
        os._exit(0)  # gone before the reduction its peer is about to start
    time.sleep(0.2)
    start = time.monotonic()
    try:
        reducer.all_reduce_(torch.ones(1000))  # type: ignore[union-attr]
        outcome.put(("returned", time.monotonic() - start))  # type: ignore[attr-defined]
    except RuntimeError as exc:
        outcome.put((str(exc), time.monotonic() - start))  # type: ignore[attr-defined]


def test_a_dead_peer_is_named_not_waited_for():
    outcome = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _dying_peer, args=(free_local_port(), outcome), nprocs=2, join=False, start_method="spawn"
    )
    try:
        message, waited_s = outcome.get(timeout=120)
    finally:
        for process in context.processes:  # rank 1 stays a zombie until joined here: the barrier must see it
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert "rank 1 of the data-parallel group" in message and "exited" in message
    assert waited_s < 5.0


def _rank_1_stays_away(aborts: bool, timeout_s: float) -> str:
    """Rank 0 reduces; rank 1 lives on but never joins, and with ``aborts`` stops the group's reductions (as
    its failure guard does) -> rank 0's error."""
    reducer = HostReduce.open(None, 1024, timeout_s=timeout_s)
    assert reducer is not None
    outcome = "returned"
    if dist.get_rank() == 0:
        try:
            reducer.all_reduce_(torch.ones(100))
        except RuntimeError as exc:
            outcome = str(exc)
    elif aborts:
        reducer.abort()
    dist.barrier()
    reducer.close()
    return outcome


def test_a_peer_that_aborts_stops_the_waiting_rank_with_its_name(run_distributed):
    start = time.monotonic()
    message = run_distributed(_rank_1_stays_away, True, 60.0)[0]
    assert "rank 1 of the group stopped its reductions" in message, message
    assert time.monotonic() - start < 30.0  # not the reducer's 60 s timeout


def test_a_peer_that_never_arrives_times_out(run_distributed):
    message = run_distributed(_rank_1_stays_away, False, 0.5)[0]
    assert "rank 1 of the data-parallel group" in message and "did not arrive within 0.5 s" in message
