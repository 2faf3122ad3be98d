"""A persistent pool of gloo worker processes, one pool per world size, shared by the whole test run.

``import megatron.core`` costs ~9 s per process, so spawning processes per test would dominate the suite.
Each pool spawns its workers once, initialises one gloo world among them and then runs test bodies on
every rank. A body is a module-level function (pickled by reference, so it must be importable from the
worker); it runs as ``fn(*args, **kwargs)`` on each rank and may query ``torch.distributed`` for its rank.
Its return values come back as a list indexed by rank. An exception on any rank fails the call with that
rank's traceback; a hang (e.g. a collective some rank never joined) times out, and the pool is then
discarded and respawned for the next test, so one broken test cannot wedge the rest of the run.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mcore_rl.parallel.launch_env import free_local_port

_PRELOAD = ("torch", "megatron.core", "megatron.core.models.gpt")


_GLOO_THREADS_BEFORE_GC = 64


def _reset_after_task() -> None:
    """Undo per-test global state a failing body may have left (megatron's parallel_state), and free the
    process groups of finished bodies when their transport loops pile up. A destroyed group's communicator
    lives until its Python objects do, and engines sit in reference cycles: before a rank's groups shared one
    transport loop (compat/gloo_device.py) each built context left ~16 loop threads, each waking 100 times a
    second, ~1000 late in the run. Now one loop serves them all and this rarely fires; what the uncollected
    groups keep is their idle worker threads (``pt_gloo_runloop``, ~300 per worker at most, measured), which
    wake for nothing: collecting them after every few tests cost the suite 10% (measured), so they wait for
    Python's own collections."""
    import gc
    import glob

    from mcore_rl.parallel.context import ParallelContext

    ParallelContext.release_active()
    threads = glob.glob("/proc/self/task/*/comm")
    if sum(_is_gloo_thread(path) for path in threads) > _GLOO_THREADS_BEFORE_GC:
        gc.collect()


def _is_gloo_thread(comm_path: str) -> bool:
    try:
        with open(comm_path) as f:
            return f.read().startswith("gloo")
    except OSError:  # the thread ended meanwhile
        return False


def _worker_main(rank: int, world_size: int, port: int, scratch: str, tasks: Any, results: Any) -> None:
    # What the libraries put in the temp folder and remove only at a normal exit (wandb's directories through
    # megatron's imports, multiprocessing's) goes to the pool's folder: this process ends in os._exit below.
    tempfile.tempdir = scratch
    os.environ.update(
        TMPDIR=scratch,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import importlib
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")  # before megatron's import
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from mcore_rl.compat.megatron_import import import_megatron_core

    import_megatron_core()  # first, as a rank's ParallelContext imports it (without inductor on CPU)
    for name in _PRELOAD:
        importlib.import_module(name)
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            _reset_after_task()
    dist.destroy_process_group()
    # The driver has every result by now. Skip the interpreter's teardown (atexit handlers, e.g. vLLM's, and
    # freeing every module's objects): 1-2 s per pool that the suite would wait for in close().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DistributedTestError(AssertionError):
    """A test body failed (or hung) on at least one rank."""


class WorkerPool:
    """``world_size`` gloo ranks kept alive across tests; see the module docstring."""

    def __init__(self, world_size: int, start_timeout_s: float = 180.0) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._scratch = tempfile.mkdtemp(prefix=f"mcore_rl_test_pool{world_size}_")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_local_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, port, self._scratch, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start", start_timeout_s)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                self.close(force=True)
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())
                raise DistributedTestError(
                    f"{what}: ranks {missing} did not finish within {timeout_s:.0f} s{detail}"
                ) from None
            (errors if status == "error" else values)[rank] = value
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedTestError(f"{what} failed on ranks {sorted(errors)}:{detail}")
        return [values[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self._scratch, ignore_errors=True)


class PoolRegistry:
    """One live pool per world size; a pool broken by a timeout is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, fn: Callable[..., Any], *args: Any, world_size: int = 2, **kwargs: Any) -> list[Any]:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(force=True)  # reaps what is left of it and removes its temp folder
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
