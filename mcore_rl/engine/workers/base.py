"""The base of every per-rank host: one process, one torch.distributed rank, one ParallelContext.

The controller starts one per rank (a Ray actor: ``controller/worker_group.py``, which adds what Ray needs),
asks rank 0 for a rendezvous address and hands it to every rank, which then joins the world through
:meth:`ParallelContext.initialize` (gloo on CPU, nccl on GPU); or the driver builds one in its own process.
Nothing here knows Ray or talks to the driver except through return values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.engine.workers.host_heap import keep_freed_host_memory_of_run
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.launch_env import rendezvous_for_init
from mcore_rl.types import RankInfo


class Worker:
    """One rank. Subclasses add role methods (generate, update, ...); ``__init__`` only stores."""

    def __init__(self, rank: int, world_size: int, num_threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.num_threads = num_threads
        self._ctx: ParallelContext | None = None

    @property
    def ctx(self) -> ParallelContext:
        if self._ctx is None:
            raise RuntimeError(f"rank {self.rank}: init_parallel() has not run")
        return self._ctx

    def init_parallel(
        self, master_addr: str, master_port: int, parallel: ParallelConfig, seed: int = 1234
    ) -> RankInfo:
        """Collective: join the world and build the ParallelContext for ``parallel`` (RNG streams from ``seed``)."""
        import warnings

        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
        torch.set_num_threads(self.num_threads)
        with rendezvous_for_init(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so its device is always index 0.
            LOCAL_RANK="0",
        ):
            self._ctx = ParallelContext.initialize(parallel, seed)
        return self.rank_info()

    def keep_freed_host_memory(self, cache_gib: float | None) -> str:
        """A CPU rank keeps freed tensor memory for reuse, at most ``cache_gib`` (``trainer.host_cache_gib``;
        ``engine/workers/host_heap.py``); one line for the log. GPU ranks are left alone."""
        if self.ctx.device.type != "cpu":
            return "host memory: left as is (GPU rank)"
        return keep_freed_host_memory_of_run(cache_gib, self.world_size)

    def rank_info(self) -> RankInfo:
        """This rank's coordinates; without a rollout engine every rank is its own rollout replica."""
        ctx = self.ctx
        return RankInfo(
            rank=ctx.rank,
            dp_rank=ctx.dp_rank,
            tp_rank=ctx.tp_rank,
            pp_rank=ctx.pp_rank,
            is_last_stage=ctx.is_last_stage,
            cp_rank=ctx.cp_rank,
            rollout_replica=ctx.rank,
            rollout_tp_rank=0,
        )

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(ctx, *args, **kwargs)`` on this rank: ad-hoc collectives for tools and tests."""
        return fn(self.ctx, *args, **kwargs)

    def shutdown(self) -> None:
        """Leave the world cleanly (the group kills the actor afterwards)."""
        if self._ctx is not None:
            self._ctx.destroy(destroy_process_group=True)
            self._ctx = None
