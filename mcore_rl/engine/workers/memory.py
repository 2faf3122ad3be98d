"""Memory per phase, measured inside the rank that runs the phase (the driver holds no engine memory).

For each phase (generate, log_probs, update, sync) a rank records its peak resident set during the phase
and, on GPU, the CUDA allocator's peak. The peak RSS is Linux's ``VmHWM``, reset at the start of the phase
through ``/proc/self/clear_refs`` (value 5, Linux >= 4.0); where that reset is refused the end-of-phase RSS
is reported instead, since the process-lifetime peak would repeat the largest phase forever. The driver
takes the maximum over ranks: the number that decides whether a rank runs out of memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def _status_bytes(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    """Per-phase peaks of one rank since the last :meth:`take`; phases that repeat keep their maximum."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        peak_resettable = _reset_peak_rss()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            rss = _status_bytes("VmHWM" if peak_resettable else "VmRSS")
            if rss is not None:
                self._keep(f"memory/{phase}_rss_bytes", rss)
            if cuda:
                self._keep(
                    f"memory/{phase}_cuda_max_allocated_bytes", float(torch.cuda.max_memory_allocated())
                )

    def _keep(self, key: str, value: float) -> None:
        self.peaks[key] = max(self.peaks.get(key, 0.0), value)

    def take(self) -> dict[str, float]:
        """The peaks recorded since the last call, and a fresh start."""
        peaks, self.peaks = self.peaks, {}
        return peaks


def measured(phase: str) -> Callable[[F], F]:
    """Decorate a worker method: its run is measured as ``phase`` in the worker's ``phase_memory``."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with phase_memory(self).measure(phase):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate


def phase_memory(worker: Any) -> PhaseMemory:
    """The worker's recorder, created on first use (worker ``__init__`` only stores its arguments)."""
    recorder = worker.__dict__.get("_phase_memory")
    if recorder is None:
        recorder = worker.__dict__["_phase_memory"] = PhaseMemory()
    return recorder


def max_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each key's maximum over the ranks that report it."""
    merged: dict[str, float] = {}
    for peaks in per_rank:
        for key, value in peaks.items():
            merged[key] = max(merged.get(key, 0.0), value)
    return merged
