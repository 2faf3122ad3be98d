"""How the driver runs a worker method on every rank: a Ray worker group, or one rank in the driver's process.

Both backends run the same worker code with the same ordering: a rank runs its calls one at a time, in the
order they were submitted (Ray's guarantee for an actor; :class:`InProcessBackend` keeps it by a queue). The
driver relies on it: it may submit a call before an earlier one has finished (the weight sync right behind the
update, a weight load behind a generation), and each call sees the effects of every call submitted before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from mcore_rl.controller.resources import shutdown_ray
from mcore_rl.controller.worker_group import Pending, WorkerGroup
from mcore_rl.types import RankInfo


class Backend(Protocol):
    """Runs one worker method on every rank of a group and returns every rank's result."""

    infos: list[RankInfo]

    def submit(self, method: str, shards: list[Any] | None, by: str, *args: Any) -> Callable[[], list[Any]]:
        """Start ``method(shard, *args)`` (or ``method(*args)`` when ``shards`` is None) on every rank;
        the returned callable waits for the per-rank results."""
        ...

    def submit_shared(self, method: str, value: Any) -> Callable[[], list[Any]]:
        """Start ``method(value)`` on every rank with one large argument, sent once (Ray: one object in the
        store, not one copy per rank)."""
        ...

    def submit_relay(self, method: str, target: Backend, target_method: str) -> Callable[[], None]:
        """Start ``method()`` on every rank here and ``target_method(result)`` on every rank of ``target``,
        where ``result`` is this group's rank 0's (the others return None); the result never passes through
        the driver. The wait surfaces both groups' errors."""
        ...

    def shutdown(self, graceful: bool = True) -> None: ...


class RayBackend:
    """A :class:`WorkerGroup` of Ray actors."""

    def __init__(self, group: WorkerGroup, owns_ray: bool = False) -> None:
        self.group = group
        self.infos = group.infos
        self.owns_ray = owns_ray
        """The driver started this local Ray for the run: shutting the group down stops Ray too, so a notebook
        or a test that builds several trainers never inherits a stale session."""

    def submit(self, method: str, shards: list[Any] | None, by: str, *args: Any) -> Callable[[], list[Any]]:
        pending = (
            self.group.call(method, *args)
            if shards is None
            else self.group.call_sharded(method, shards, by, *args)
        )
        return lambda: self.group.get(pending)

    def submit_shared(self, method: str, value: Any) -> Callable[[], list[Any]]:
        import ray

        ref = value if isinstance(value, ray.ObjectRef) else ray.put(value)
        return self.submit(method, None, "", ref)  # a top-level ref: Ray resolves it on each rank

    def submit_relay(self, method: str, target: Backend, target_method: str) -> Callable[[], None]:
        import ray

        if not isinstance(target, RayBackend):
            raise TypeError("submit_relay: both groups must be Ray worker groups")
        produced = self.group.call(method)
        consume = target.submit(target_method, None, "", produced.refs[0])
        # The other ranks' results (None) are only awaited for their errors; a placeholder keeps
        # WorkerGroup.get's rank numbering without fetching rank 0's result to the driver.
        others = Pending(produced.method, [ray.put(None), *produced.refs[1:]])

        def wait() -> None:
            consume()
            self.group.get(others)

        return wait

    def shutdown(self, graceful: bool = True) -> None:
        self.group.shutdown(graceful=graceful)
        if self.owns_ray:
            shutdown_ray()


def hand_over_ray(backend: Backend, owns_ray: bool) -> bool:
    """Set whether stopping ``backend`` stops the local Ray too (a Ray backend; else nothing); returns what it
    was. A recovery keeps the run's Ray across the restart of its workers: the old group lets go of it, the new
    one takes it."""
    if not isinstance(backend, RayBackend):
        return False
    owned, backend.owns_ray = backend.owns_ray, owns_ray
    return owned


class InProcessBackend:
    """One rank (world size 1) in the driver's own process: no Ray, no copies.

    Calls run as a Ray actor runs them: one at a time, in the order they were submitted. A call runs when
    its result, or that of a later call, is awaited, so that the driver's timers around a wait measure the
    same work on both backends; an error stays with its own call, as with Ray."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.infos = [worker.rank_info()]
        self._queue: deque[_QueuedCall] = deque()

    def submit(self, method: str, shards: list[Any] | None, by: str, *args: Any) -> Callable[[], list[Any]]:
        fn = getattr(self.worker, method)
        call = _QueuedCall(lambda: fn(*args) if shards is None else fn(shards[0], *args))
        self._queue.append(call)

        def wait() -> list[Any]:
            while not call.done:
                self._queue.popleft().run()
            return call.result()

        return wait

    def submit_shared(self, method: str, value: Any) -> Callable[[], list[Any]]:
        return self.submit(method, None, "", value)

    def submit_relay(self, method: str, target: Backend, target_method: str) -> Callable[[], None]:
        raise TypeError("a group in the driver's process has no peer group to relay to (use Ray)")

    def shutdown(self, graceful: bool = True) -> None:
        self.worker.shutdown()


class _QueuedCall:
    """One pending in-process call: its result, or its error raised where it is awaited."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as err:  # kept for the caller that awaits this call
            self.error = err
        self.done = True

    def result(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        return [self.value]
