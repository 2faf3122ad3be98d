"""Termination signals become an exception in the main thread, so every ``except``/``finally`` cleanup runs.

Python's default SIGTERM and SIGHUP end the process at once, skipping cleanup: a conversion killed that
way used to leave hundreds of MB of hidden staging folders. Under :func:`raise_on_signals`, SIGTERM,
SIGINT and SIGHUP raise :class:`~mcore_rl.io.errors.Interrupted` instead; the CLI turns it into one line
and exit code ``128 + signum``. :func:`signals_deferred` holds signals back during a few renames that must
not be split (the commit of an output folder); a signal that arrived meanwhile is delivered right after.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from mcore_rl.io.errors import Interrupted

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def raise_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT/SIGHUP raise :class:`Interrupted` (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Block the handled signals for the duration of the block (a pending one is delivered afterwards)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
