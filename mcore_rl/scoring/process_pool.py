"""Untrusted user code in worker processes: a per-call time limit, a memory cap, and a worker that hangs or
dies replaced instead of stalling the run. The machinery of the scorer pool (``pool.py``: spawned workers that
say when they are ready, one task each at a time, a deadline per task, kill and replace), for any task.

    pool = TaskPool(handler_factory, TaskLimits(num_workers=2, timeout_s=5, memory_limit_bytes=1 << 30))
    pool.run([task, ...]) -> [("ok", value) | ("error", "ValueError: ...") | ("timeout", "over 5 s"), ...]

``handler_factory`` is a picklable callable (a module-level function, or a ``functools.partial`` of one): each
worker calls it once after it starts, before it says it is ready (so imports never count against a task), and
then ``handler(task) -> value`` for each task it gets. A handler that raises reports ``("error", "Type:
message")``; the worker goes on. A value the calling process cannot unpickle (return plain data) is reported
the same way, and its worker replaced. With ``num_workers == 0`` tasks run in the calling process: no memory
cap, and the time limit is an alarm signal that interrupts the handler (main thread only; code stuck in native
calls that ignore signals is only stopped by a worker's kill).

The memory cap is ``RLIMIT_AS`` set to what the worker's address space holds once ready plus
``memory_limit_bytes``, so an allocation past it raises ``MemoryError`` inside the handler (reported as an
error) rather than the machine's OOM killer choosing a victim. Workers run in a private temporary folder
(removed with the pool), so files a tool writes land there.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

START_LIMIT_S = 120.0
"""A worker that has not finished starting after this long is a broken environment, not a slow task."""

Outcome = tuple[str, Any]
"""``("ok", value)``, ``("error", "Type: message")`` or ``("timeout", "over N s")``."""


class WorkerStartError(RuntimeError):
    """A worker died or hung before it took any work: the environment is broken, replacing it would loop."""


@dataclass(frozen=True)
class TaskLimits:
    """How a :class:`TaskPool` runs its tasks."""

    num_workers: int = 2
    """Worker processes; 0 runs tasks in the calling process (no time limit, no memory cap)."""
    timeout_s: float = 10.0
    """Per-task limit; past it the worker is killed and replaced, and the task reports a timeout."""
    memory_limit_bytes: int | None = None
    """Address space a worker may add to what it holds when ready; None: no cap."""
    what: str = "worker"
    """What the workers are, for messages (``scorer``, ``tool``)."""


class _Timeout(BaseException):
    """The alarm of an in-process task past its limit (a BaseException: a handler's own ``except Exception``
    does not swallow it)."""


def run_task(handler: Callable[[Any], Any], task: Any, timeout_s: float | None = None) -> Outcome:
    """``handler(task)`` as an outcome: a handler may raise anything; it is reported, not fatal.
    ``timeout_s`` (under :func:`alarms`) interrupts it past the limit."""
    try:
        if timeout_s is not None:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return "ok", handler(task)
        finally:
            if timeout_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return "timeout", f"over {timeout_s} s"
    except Exception as err:
        return "error", f"{type(err).__name__}: {err}"


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _Timeout


@contextlib.contextmanager
def alarms() -> Iterator[bool]:
    """SIGALRM interrupts a task past its limit while the block runs (main thread only: yields whether it is
    armed)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _address_space_bytes() -> int | None:
    """This process's virtual memory size (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cap_memory(extra_bytes: int) -> bool:
    """Limit this process's address space to its current size plus ``extra_bytes``; False where unsupported."""
    size = _address_space_bytes()
    if size is None:
        return False
    import resource

    limit = size + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return True


def _worker_main(
    conn: Connection, factory: Callable[[], Callable[[Any], Any]], limits: TaskLimits, cwd: str
) -> None:
    """Worker process: build the handler, cap memory, say ready, then answer ``(index, task)`` until None."""
    handler = factory()
    os.chdir(cwd)
    if limits.memory_limit_bytes is not None:
        cap_memory(limits.memory_limit_bytes)
    conn.send("ready")
    try:
        while (message := conn.recv()) is not None:
            index, task = message
            conn.send((index, *run_task(handler, task)))
    except (EOFError, OSError):  # the pool's process ended without closing it: nothing left to answer
        pass


class _Worker:
    def __init__(self, ctx: Any, factory: Callable[[], Callable[[Any], Any]], limits: TaskLimits, cwd: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, factory, limits, cwd), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, float] | None = None
        """(task index, deadline) while busy."""

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class TaskPool:
    """Runs tasks in spawned workers (module docstring); a context manager owning its processes."""

    def __init__(self, factory: Callable[[], Callable[[Any], Any]], limits: TaskLimits) -> None:
        self.factory = factory
        self.limits = limits
        self._ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and memory
        self._workers: list[_Worker] = []
        self._handler: Callable[[Any], Any] | None = None
        self._cwd: str | None = None

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for worker in self._workers:
            if worker.process.is_alive():
                with contextlib.suppress(OSError):  # already gone: nothing to tell it
                    worker.conn.send(None)
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None

    def run(self, tasks: Sequence[Any]) -> list[Outcome]:
        """Each task's outcome, in order; the workers take them as they free up."""
        if self.limits.num_workers == 0:
            if self._handler is None:
                self._handler = self.factory()
            handler = self._handler
            with alarms() as armed:
                limit = self.limits.timeout_s if armed else None
                return [run_task(handler, t, limit) for t in tasks]
        if self._cwd is None:
            self._cwd = tempfile.mkdtemp(prefix=f"mcore_rl_{self.limits.what}_")
        while len(self._workers) < self.limits.num_workers:
            self._workers.append(self._spawn())
        results: list[Outcome | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        try:
            while pending or any(w.task for w in self._workers):
                for worker in list(self._workers):
                    if worker.ready and worker.task is None and pending:
                        self._hand_out(worker, pending, tasks, results)
                self._wait_and_receive(results)
        except BaseException:  # a failed start, an interrupt
            self._drop_busy()
            raise
        return [r if r is not None else ("error", "no result") for r in results]

    def _drop_busy(self) -> None:
        """Kill the workers still holding a task of a run that ends early: a late answer would otherwise be
        read by the next run and written into its slot of that index, another request's (the next run
        starts fresh workers in their place)."""
        for worker in [w for w in self._workers if w.task is not None]:
            worker.kill()
            self._workers.remove(worker)

    def _hand_out(
        self, worker: _Worker, pending: deque[int], tasks: Sequence[Any], results: list[Outcome | None]
    ) -> None:
        """Send ``worker`` the next pending task; a worker that died idle since it last answered (the OOM
        killer, a stray signal) is replaced and the task waits for the next free one."""
        index = pending.popleft()
        try:
            if not worker.process.is_alive():
                raise BrokenPipeError("the worker process is gone")
            worker.conn.send((index, tasks[index]))
        except OSError:
            pending.appendleft(index)
            self._replace(worker, results, None)  # it held no task: nothing is recorded
            return
        worker.task = (index, time.monotonic() + self.limits.timeout_s)

    def _spawn(self) -> _Worker:
        assert self._cwd is not None
        return _Worker(self._ctx, self.factory, self.limits, self._cwd)

    def _wait_and_receive(self, results: list[Outcome | None]) -> None:
        """Wait for the first answer or deadline; record answers, kill and replace late or dead workers."""
        now = time.monotonic()
        deadlines = [w.task[1] for w in self._workers if w.task] or [now + 1.0]
        by_conn = {id(w.conn): w for w in self._workers}
        for conn in wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - now)):
            worker = by_conn[id(conn)]
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=5)
                died = f"worker process died (exit code {worker.process.exitcode})"
                if not worker.ready:  # it never took work: replacing it would loop forever
                    raise WorkerStartError(f"a {self.limits.what} worker failed to start: {died}") from None
                self._replace(worker, results, died)
                continue
            except Exception as err:  # e.g. a result of a class only the worker imported cannot be unpickled
                # here: its task's error, and the worker replaced, so nothing more of it is ever read
                unread = f"its result could not be read here ({type(err).__name__}: {err})"
                self._replace(worker, results, unread)
                continue
            if message == "ready":
                worker.ready = True
            else:
                index, status, value = message
                results[int(index)] = (str(status), value)
                worker.task = None
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task and worker.task[1] <= now:
                self._replace(worker, results, None)
            elif not worker.ready and now - worker.started > START_LIMIT_S:
                raise WorkerStartError(
                    f"a {self.limits.what} worker did not start within {START_LIMIT_S:.0f} s"
                )

    def _replace(self, worker: _Worker, results: list[Outcome | None], error: str | None) -> None:
        if worker.task is not None:
            index = worker.task[0]
            results[index] = ("error", error) if error else ("timeout", f"over {self.limits.timeout_s} s")
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()
