"""Termination signals become an exception in the main thread, so every ``except``/``finally`` cleanup runs.

Python's default SIGTERM and SIGHUP end the process at once, skipping cleanup: a conversion killed that
way used to leave hundreds of MB of hidden staging folders. Under :func:`raise_on_signals`, SIGTERM,
SIGINT, SIGHUP and SIGUSR1 raise :class:`~mcore_rl.io.errors.Interrupted` instead; the CLI turns it into one
line and exit code ``128 + signum``. :func:`signals_deferred` holds signals back during a few renames that must
not be split (the commit of an output folder); a signal that arrived meanwhile is delivered right after.

A training run's RL loop runs under :func:`stop_requests`: there SIGTERM and SIGUSR1 (what a scheduler sends
before it preempts a job or its time runs out: Slurm's ``--signal``) only ask the run to stop at the end of
its step, so it can save a checkpoint first; a second one, or SIGINT, interrupts at once as above.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from mcore_rl.io.errors import Interrupted

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that ask a training run to stop after its current step (:func:`stop_requests`)."""


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def raise_on_signals() -> Iterator[None]:
    """Within the block, the :data:`HANDLED_SIGNALS` raise :class:`Interrupted` (main thread only; else a
    no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopRequest:
    """Whether a stop was asked for (:func:`stop_requests`), and by which signal."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # asked twice: the user (or the scheduler) will not wait for the step
            raise Interrupted(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_requests(request: StopRequest | None = None) -> Iterator[StopRequest]:
    """Within the block, the first SIGTERM or SIGUSR1 sets the yielded :class:`StopRequest` (the caller checks
    it where stopping is safe) and a second one raises :class:`Interrupted`; outside the main thread nothing is
    installed and the request stays unset. Given ``request`` (one an earlier block may have set already), the
    block records into it: a stop asked for before a lost worker's recovery still stands after it."""
    request = StopRequest() if request is None else request
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request.handle) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def reclaim_handlers(handlers: Mapping[signal.Signals, Any]) -> None:
    """Install ``handlers`` (signal -> Python handler, as :func:`signal.getsignal` returned them) again at the
    C level: a library that installs native handlers of its own (Ray's core worker prints a stack dump and
    exits 15 on SIGTERM) must not take the signals this process handles. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in handlers.items():
        if handler is not None:  # None: installed outside Python, nothing of ours to put back
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold the handled signals back for the duration of the block; one that arrived meanwhile is delivered
    right after it, to the handler in place before.

    In the main thread the Python handlers are swapped for one that only records the signal: blocking the
    signal for this thread alone (``pthread_sigmask``) is not enough, as the kernel then delivers a
    process-directed signal to another thread (torch's, faulthandler's), whose C handler still makes Python
    run the handler here at the next bytecode (found by a test: an interrupt landed between the two writes of
    ``latest``). Elsewhere (no Python handlers can be set there) the signals are blocked for the thread."""
    if threading.current_thread() is not threading.main_thread():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(arrived):  # each signal once, in order, as the kernel would merge them
            signal.raise_signal(signum)
