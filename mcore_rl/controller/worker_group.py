"""A group of Ray actors, one torch.distributed rank each, driven by the single controller.

Every call fans out to all ranks (they run collectives together) and is awaited with :meth:`WorkerGroup.get`,
which waits on all ranks' results at once and fails fast: the first rank that raises, or whose process dies
(kill -9, OOM), ends the call within about a second with that rank and its traceback, and the whole group
is killed, since the surviving ranks would otherwise wait in a collective until its 30-minute timeout. A
call that does not finish within the group's ``phase_timeout_s`` is a hang (``watchdog.py``): the late ranks'
stacks are written and the call fails naming them. :attr:`WorkerError.kind` tells the three apart, so the
driver can recover from a lost rank and from nothing else.

Bulk data moves as whole shards: ``call_sharded`` puts each shard in the object store once and hands the
same reference to every rank that consumes it (the TP/PP peers of one DP replica); the driver never loops
over samples.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.controller import watchdog
from mcore_rl.controller.dispatch import shard_of_rank
from mcore_rl.controller.resources import ResourcePool
from mcore_rl.controller.tensor_transport import register_tensor_transport
from mcore_rl.io.host import process_exists
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.types import RankInfo

ROOT_CAUSE_WAIT_S = 3.0
"""How long a rank's error waits for the other ranks' results, in case one of them died (the cause)."""


class WorkerError(RuntimeError):
    """A worker raised, died or hung; the message names the rank, the method and carries its traceback."""

    RAISED, DIED, HUNG = "raised", "died", "hung"

    def __init__(
        self, rank: int, method: str, detail: str, cause: BaseException | None = None, kind: str = RAISED
    ) -> None:
        detail = re.sub(r"\x1b\[[0-9;]*m", "", detail)  # Ray colours its task names for terminals
        message = detail if kind == self.HUNG else f"rank {rank} failed in {method}: {detail}"
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.cause = cause
        """The exception the rank raised, as itself (None when it died), so that the driver can tell a typed
        failure (e.g. a NaN loss) from the rest without reading the message."""
        self.kind = kind
        """:attr:`RAISED` (the rank's code raised: a bug or bad input, the same again on a retry),
        :attr:`DIED` (its process is gone: killed, out of memory, its node left) or :attr:`HUNG` (a phase past
        its timeout)."""
        self.group_alive = False
        """The group was left running: every rank had finished the call (it raised on them alike), so the
        driver may go on with it (a checkpoint save the disk refused)."""

    @property
    def died(self) -> bool:
        return self.kind == self.DIED


_PORT_ATTEMPTS = 3


class _RayRank:
    """What a rank needs as a Ray actor, mixed into the worker class at :meth:`WorkerGroup.spawn` (the worker
    classes themselves know nothing of Ray)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        register_tensor_transport()  # this actor's own Ray serialization context
        super().__init__(*args, **kwargs)

    def redirect_output(self, folder: str) -> str:
        """This rank's stdout and stderr (Python warnings, megatron's and vLLM's logs, prints of native code)
        into ``folder/<worker class>_rank<k>.log`` instead of the driver's console; returns the file. Errors
        still reach the driver with their traceback (``WorkerError``)."""
        import sys

        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{type(self).__name__}_rank{self.rank}.log")  # type: ignore[attr-defined]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return path

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 only: this node's IP and a port free on it, for every rank's MASTER_ADDR/PORT."""
        import socket

        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            return address, int(s.getsockname()[1])

    def process_id(self) -> tuple[str, int]:
        """This actor's node and process id (the group watches the process end at shutdown)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def exit_process(self) -> None:
        """End this actor's process the way Python ends: its exit handlers run, so what the libraries it
        imported keep until exit is theirs to remove (e.g. wandb's temporary directories, which megatron's
        inference engine imports); ``ray.kill`` alone would leave them in the node's temp folder per run."""
        import gc

        import ray

        # Python's last collection would walk every object of torch, megatron and the engine (1.3 s of the
        # 1.4 s a rank took to end, sampled); frozen, they are left to the process's end like ray.kill leaves them
        gc.freeze()
        ray.actor.exit_actor()

    def configure_watchdog(self, folder: str, timeout_s: float) -> None:
        """Arm the hang watchdog around each phase of this rank (``watchdog.py``); stacks go to ``folder``."""
        path = watchdog.stack_file(folder, type(self).__name__, self.rank)  # type: ignore[attr-defined]
        watchdog.configure(self, path, timeout_s)


def ray_actor_class(worker_cls: type) -> type:
    """``worker_cls`` with :class:`_RayRank` mixed in, under the same name (Ray's logs show it), its phases
    under the hang watchdog."""
    members = {
        "__qualname__": worker_cls.__qualname__,
        **watchdog.watched_methods(worker_cls, skip=[_RayRank]),
    }
    return type(worker_cls.__name__, (_RayRank, worker_cls), members)


@dataclass(frozen=True)
class Pending:
    """The in-flight results of one call on every rank (object refs in rank order)."""

    method: str
    refs: list[Any]


class WorkerGroup:
    """``world_size`` actors of one worker class on a resource pool. Build with :meth:`spawn`."""

    def __init__(self, actors: list[Any], pool: ResourcePool, owns_pool: bool) -> None:
        self.actors = actors
        self.pool = pool
        self.owns_pool = owns_pool
        self.infos: list[RankInfo] = []
        self._alive = True
        self.phase_timeout_s: float | None = None
        """A phase (any call but start-up's) still running after this long is a hang; None: no limit."""
        self.stack_files: dict[int, str] = {}
        """rank -> where its stacks go when one of its phases hangs."""
        self._queued: list[Pending] = []
        """Calls submitted and not yet seen finished, in submission order: a rank runs them one after another,
        so a call's time limit starts when those before it have finished (``_wait_for_earlier``)."""

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @classmethod
    def spawn(
        cls,
        worker_cls: type,
        world_size: int,
        parallel: ParallelConfig | None = None,
        pool: ResourcePool | None = None,
        worker_args: Sequence[Any] = (),
        start_timeout_s: float = 300.0,
        take_pool: bool = False,
        seed: int = 1234,
        output_dir: str | None = None,
        phase_timeout_s: float | None = None,
        stacks_dir: str | None = None,
    ) -> WorkerGroup:
        """Start one actor per rank on ``pool`` (default: a new pool sharing the cluster's CPUs), form the
        torch.distributed world and build each rank's ParallelContext. ``output_dir``: each rank's stdout and stderr
        go to a file there (``_RayRank.redirect_output``), not the driver's console. ``take_pool``: the group owns the given
        pool and removes it at shutdown, also when starting fails (no placement group outlives a failed run).
        ``phase_timeout_s`` with ``stacks_dir``: the hang watchdog (``watchdog.py``).

        The rendezvous port is picked free on rank 0's node and bound a moment later by its TCPStore; another
        process can take it in between, so a start that fails with EADDRINUSE is retried on a fresh port."""
        owns_pool = pool is None or take_pool
        pool = pool or ResourcePool.for_world(world_size)
        for attempt in range(_PORT_ATTEMPTS):
            try:
                group = cls._spawn_once(
                    worker_cls, world_size, parallel, pool, worker_args, start_timeout_s, seed, output_dir
                )
                group.owns_pool = owns_pool
                if phase_timeout_s is not None and stacks_dir is not None:
                    group._arm_watchdog(worker_cls.__name__, phase_timeout_s, stacks_dir, start_timeout_s)
                return group
            except WorkerError as err:
                if attempt + 1 < _PORT_ATTEMPTS and "EADDRINUSE" in str(err):
                    continue
                if owns_pool:
                    pool.remove()
                raise
            except BaseException:
                if owns_pool:
                    pool.remove()
                raise
        raise AssertionError("unreachable")

    @classmethod
    def _spawn_once(
        cls,
        worker_cls: type,
        world_size: int,
        parallel: ParallelConfig | None,
        pool: ResourcePool,
        worker_args: Sequence[Any],
        start_timeout_s: float,
        seed: int,
        output_dir: str | None,
    ) -> WorkerGroup:
        """One attempt of :meth:`spawn`; a failure kills the actors and leaves the pool to the caller."""
        import ray

        if pool.num_bundles < world_size:
            raise ValueError(f"pool has {pool.num_bundles} bundles, world_size {world_size} needs one each")
        threads = max(1, int(pool.cpus_per_bundle))
        remote_cls = ray.remote(ray_actor_class(worker_cls))
        actors = [
            remote_cls.options(
                num_cpus=pool.cpus_per_bundle,
                num_gpus=pool.gpus_per_bundle,
                scheduling_strategy=pool.scheduling(rank),
                max_restarts=0,
            ).remote(rank, world_size, threads, *worker_args)
            for rank in range(world_size)
        ]
        group = cls(actors, pool, owns_pool=False)
        try:
            if output_dir is not None:  # before the world forms: its warnings go there too
                group.get(group.call("redirect_output", output_dir), timeout_s=start_timeout_s)
            first = Pending("rendezvous_address", [actors[0].rendezvous_address.remote()])
            address, port = group.get(first, timeout_s=start_timeout_s)[0]
            group.infos = group.get(
                group.call("init_parallel", address, port, parallel or ParallelConfig(), seed)
            )
        except BaseException:
            group.shutdown()
            raise
        return group

    def _arm_watchdog(self, class_name: str, timeout_s: float, folder: str, start_timeout_s: float) -> None:
        try:
            self.get(self.call("configure_watchdog", folder, timeout_s), timeout_s=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.phase_timeout_s = timeout_s
        self.stack_files = {r: watchdog.stack_file(folder, class_name, r) for r in range(self.world_size)}

    # --- calls ----------------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        """``method(*args, **kwargs)`` on every rank, without waiting."""
        self._check_alive()
        return self._queue(Pending(method, [getattr(a, method).remote(*args, **kwargs) for a in self.actors]))

    def _queue(self, pending: Pending) -> Pending:
        if self.phase_timeout_s is not None and pending.method not in watchdog.UNWATCHED:
            self._queued.append(pending)
        return pending

    def _take_queued(self, pending: Pending) -> list[Pending]:
        """The calls queued before ``pending`` (``pending`` itself leaves the queue)."""
        for i, queued in enumerate(self._queued):
            if queued is pending:
                earlier, self._queued = self._queued[:i], self._queued[i + 1 :]
                return earlier
        return []

    def call_sharded(self, method: str, shards: Sequence[Any], by: str, *args: Any) -> Pending:
        """``method(shard, *args)`` on every rank, with shard ``d`` going to the ranks whose ``by`` coordinate
        (``'dp'`` or ``'rollout'``) is ``d``. A shard several ranks read enters the object store once; one read
        by a single rank goes with its call (Ray inlines a small one in the task and stores a large one itself),
        which saves the separate ``ray.put`` round trip on every step of a one-rank-per-shard layout."""
        import ray

        self._check_alive()
        which = shard_of_rank(self.infos, by)
        if max(which) + 1 != len(shards):
            raise ValueError(
                f"{method}: {len(shards)} shards for {max(which) + 1} '{by}' shards of the group"
            )
        readers = [which.count(d) for d in range(len(shards))]
        refs = [ray.put(s) if readers[d] > 1 else s for d, s in enumerate(shards)]
        calls = [getattr(a, method).remote(refs[d], *args) for a, d in zip(self.actors, which, strict=True)]
        return self._queue(Pending(method, calls))

    def _wait_for_earlier(self, earlier: list[Pending]) -> None:
        """Wait, each under the phase limit, for the calls submitted before this one to finish on every rank
        (their results stay for their own ``get``): they run first, and their time is not this call's. PPO
        awaits the actor's update queued behind the critic's on the same ranks."""
        import ray

        assert self.phase_timeout_s is not None
        limit = self.phase_timeout_s + watchdog.GRACE_S
        for call in earlier:
            _, waiting = ray.wait(call.refs, num_returns=len(call.refs), timeout=limit)
            if waiting:
                self._late(call.method, call.refs, waiting, watched=True, timeout_s=limit)

    def _late(
        self, method: str, refs: list[Any], waiting: list[Any], watched: bool, timeout_s: float | None
    ) -> None:
        """Raise for the ranks of ``method`` that did not answer in time, killing the group."""
        self.shutdown()
        rank_of = {ref: r for r, ref in enumerate(refs)}
        late = sorted(rank_of[r] for r in waiting)
        if watched:
            assert self.phase_timeout_s is not None
            done = sorted(set(range(len(refs))) - set(late))
            files = {r: self.stack_files[r] for r in late}
            detail = watchdog.hang_message(method, self.phase_timeout_s, late, done, files)
            raise WorkerError(late[0], method, detail, kind=WorkerError.HUNG)
        raise WorkerError(late[0], method, f"ranks {late} did not answer within {timeout_s} s")

    def get(self, pending: Pending, timeout_s: float | None = None) -> list[Any]:
        """Every rank's result (rank order), failing fast on the first error; see the module docstring."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        method, refs = pending.method, pending.refs
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        waiting = list(refs)
        watched = timeout_s is None and self.phase_timeout_s is not None and method not in watchdog.UNWATCHED
        earlier = self._take_queued(pending)
        if watched:
            assert self.phase_timeout_s is not None
            self._wait_for_earlier(earlier)
            timeout_s = self.phase_timeout_s + watchdog.GRACE_S  # the late ranks' stacks are written by then
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=remaining)
            if not ready:
                self._late(method, refs, waiting, watched, timeout_s)
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except (RayTaskError, RayActorError, GetTimeoutError) as err:
                    rank, cause, all_finished = _root_cause(rank_of[ref], err, waiting, rank_of)
                    if isinstance(cause, RayActorError):
                        self.shutdown()
                        raise WorkerError(rank, method, _died(cause), kind=WorkerError.DIED) from None
                    # Every rank finished the call (each returned or raised, e.g. a save that failed on all of
                    # them alike): none waits in a collective, so the group stays usable; else it is killed.
                    if not all_finished:
                        self.shutdown()
                    raised = cause.cause if isinstance(cause, RayTaskError) else None
                    error = WorkerError(rank, method, str(cause), raised)
                    error.group_alive = all_finished
                    raise error from None
        return results

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``get(call(method, ...))``: every rank's result."""
        return self.get(self.call(method, *args, **kwargs))

    # --- lifetime -------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("this worker group was shut down")

    def shutdown(self, graceful: bool = False) -> None:
        """Kill every actor (after leaving the world cleanly when ``graceful``) and free the pool."""
        import ray

        if not self._alive:
            return
        self._alive = False
        if graceful:
            # A rank that is already gone must not keep the others alive.
            with contextlib.suppress(Exception):
                ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
            _exit_processes(self.actors)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        watchdog.remove_unwritten(list(self.stack_files.values()))  # a healthy run's leave no file
        if self.owns_pool:
            self.pool.remove()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(graceful=exc[0] is None)


def _exit_processes(actors: list[Any], timeout_s: float = 30.0) -> None:
    """Each actor's process ends through :meth:`_RayRank.exit_process`; the caller kills what is left.

    The exit call's error comes back as soon as the actor stops taking calls, before its process has run the
    exit handlers (and Ray reports it dead from that moment too), so the processes on this node are watched
    until they are gone; on another node the caller's kill may still cut its handlers short."""
    import ray

    deadline = time.monotonic() + timeout_s
    here = ray.get_runtime_context().get_node_id()
    try:
        where = ray.get([a.process_id.remote() for a in actors], timeout=timeout_s)
    except Exception:  # a rank already gone: nothing of it to wait for
        where = []
    exits = [a.exit_process.remote() for a in actors]
    ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
    local = [pid for node, pid in where if node == here]
    while any(process_exists(pid) for pid in local) and time.monotonic() < deadline:
        time.sleep(0.02)


def _died(err: Exception) -> str:
    """Ray's long account of a dead actor, in one line: it died, and Ray's first reason."""
    text = " ".join(str(err).split())
    reason = re.search(r"(The actor died[^.]*\.|The actor is dead[^.]*\.|[^.]*exited[^.]*\.)", text)
    return f"its process died ({reason.group(1).strip() if reason else type(err).__name__})"


def _root_cause(
    rank: int, err: Exception, waiting: list[Any], rank_of: dict[Any, int]
) -> tuple[int, Exception, bool]:
    """The failure to report, and whether every rank has finished the call: a peer's error often arrives first
    when a rank dies (its gloo pairs reset), so a rank that died (kill -9, OOM) within a few seconds is named
    instead, being the cause."""
    import ray
    from ray.exceptions import RayActorError

    if isinstance(err, RayActorError) or not waiting:
        return rank, err, not waiting
    ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=ROOT_CAUSE_WAIT_S)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as died:
            return rank_of[ref], died, False
        except Exception:  # another consequence of the same failure
            continue
    return rank, err, len(ready) == len(waiting)
