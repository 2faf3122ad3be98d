"""The hang watchdog of a worker group: a phase that does not finish in time is named, with every rank's stack.

A phase is one call on every rank of a group (generate, log-probs, update, weight sync, a checkpoint; any
collective inside them). Each rank arms :func:`faulthandler.dump_traceback_later` when a call starts and
cancels it when the call returns, so a rank still inside a call after ``phase_timeout_s`` writes the Python
stack of every thread to ``<stacks_dir>/<Class>_rank<k>.txt`` from faulthandler's own C thread (no GIL
needed: it works while the rank is stuck in a collective or in native code). The driver waits for the phase
``phase_timeout_s`` + :data:`GRACE_S` from when the phase can start, after the calls queued before it on the
same ranks (each waited for under its own limit), and then fails naming the phase, the ranks that did not
finish and where each was stuck (:func:`hang_message`); the process group's own timeout (30 minutes by
default) no longer decides how long a user waits.

Start-up and teardown (:data:`UNWATCHED`: forming the world, building the engines, which may load a large
model for a long time) are not phases.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import IO, Any

GRACE_S = 5.0
"""Seconds the driver waits past ``phase_timeout_s``: the late ranks' stacks are written by then."""
UNWATCHED = frozenset(
    {
        "redirect_output",
        "configure_watchdog",
        "rendezvous_address",
        "init_parallel",
        "keep_freed_host_memory",
        "build",
        "build_critic",
        "build_reward_model",
        "pid",
        "shutdown",
    }
)
"""Methods that are start-up or teardown, not phases: no watchdog."""
_ATTRIBUTE = "_mcore_rl_watchdog"


def stack_file(folder: str, worker_class: str, rank: int) -> str:
    return os.path.join(folder, f"{worker_class}_rank{rank}.txt")


class RankWatchdog:
    """One rank's side: arms faulthandler around each outermost watched call (calls a method makes on its own
    worker are inside the same phase).

    Nothing is written unless a phase is late: faulthandler's own ``Timeout (h:mm:ss)!`` line heads each dump.
    Its C thread writes to a descriptor it was given and cannot create a file when it fires, so the file is
    opened at the first phase and kept open (no file operation per phase); the driver removes the files no
    phase wrote into when the group shuts down (:func:`remove_unwritten`), and a rank killed first leaves at
    most an empty one, never a line claiming a hang."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.depth = 0
        self.file: IO[str] | None = None

    def watch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.depth == 0:
            if self.file is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.file = open(self.path, "a")  # noqa: SIM115 (faulthandler writes to its descriptor later)
            faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self.file)
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1
            if self.depth == 0:
                faulthandler.cancel_dump_traceback_later()


def remove_unwritten(paths: Sequence[str]) -> None:
    """The stack files no late phase wrote into (a healthy run's, empty), and their folder where that leaves it
    empty; a file with a dump stays."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.getsize(path) == 0:
                os.remove(path)
    for folder in {os.path.dirname(p) for p in paths}:
        with contextlib.suppress(OSError):  # not empty: another group's file or a dump in it
            os.rmdir(folder)


def configure(worker: Any, path: str, timeout_s: float) -> None:
    """Install a :class:`RankWatchdog` on ``worker`` (in the rank's process)."""
    setattr(worker, _ATTRIBUTE, RankWatchdog(path, timeout_s))


def watched_methods(worker_cls: type, skip: Sequence[type] = ()) -> dict[str, Callable[..., Any]]:
    """Every public method of ``worker_cls`` (but :data:`UNWATCHED` and those of the classes in ``skip``)
    wrapped to run under the rank's watchdog once :func:`configure` installed one (as is, before)."""
    skipped = {name for cls in skip for name in vars(cls)}
    wrapped: dict[str, Callable[..., Any]] = {}
    for name in dir(worker_cls):
        if name.startswith("_") or name in UNWATCHED or name in skipped:
            continue
        fn = inspect.getattr_static(worker_cls, name)
        if inspect.isfunction(fn):  # plain methods only (no static/class methods, properties, attributes)
            wrapped[name] = _watched(fn)
    return wrapped


def _watched(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        watchdog = self.__dict__.get(_ATTRIBUTE)
        if watchdog is None:
            return fn(self, *args, **kwargs)
        return watchdog.watch(fn, self, *args, **kwargs)

    return call


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def where_stuck(path: str) -> str | None:
    """``function (file:line)`` of the innermost frame of the main thread (where a rank runs its calls) in the
    last dump in ``path``, or None. faulthandler lists threads newest first, so the main thread is the last
    block, and each block's frames innermost first."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    dump = text.rsplit("Timeout (", 1)
    if len(dump) < 2:
        return None
    threads = re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+", dump[1], flags=re.MULTILINE)
    for line in threads[-1].splitlines():
        match = _FRAME.search(line)
        if match is not None:
            file, lineno, function = match.groups()
            return f"{function} ({os.path.basename(file)}:{lineno})"
    return None


def hang_message(
    method: str, timeout_s: float, late: list[int], done: list[int], files: dict[int, str]
) -> str:
    """The one line of a hung phase: which, how long, the ranks that did not finish and where each was."""
    where = [f"rank {r} in {w}" for r in late if (w := where_stuck(files[r])) is not None]
    folder = os.path.dirname(next(iter(files.values()))) if files else None
    stacks = f"; Python stacks in {folder}" if folder else ""
    return (
        f"phase {method!r} made no progress for {timeout_s:g} s (trainer.phase_timeout_s): ranks {late} did "
        f"not finish{f' (ranks {done} did)' if done else ''}{': ' + ', '.join(where) if where else ''}{stacks}"
    )
