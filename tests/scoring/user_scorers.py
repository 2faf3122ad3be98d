"""User scorers for the tests, loaded as ``tests.scoring.user_scorers:NAME`` (also inside spawned workers), and
task handlers for the process pool's own tests."""

from __future__ import annotations

import os
import time
from typing import Any


def with_metrics(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]) -> Any:
    """A dict score with extra metrics; misbehaves on request, to exercise the error paths."""
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "raise":
        raise RuntimeError("scorer bug")
    if solution_str == "nan":
        return float("nan")
    if solution_str == "die":
        os._exit(3)
    if solution_str == "no-score":
        return {"accuracy": 1.0}
    if solution_str == "text":
        return "seven"
    return {"score": float(solution_str == ground_truth), "length": len(solution_str), "note": "text"}


class Unreadable:
    """A result the worker can pickle and the driver cannot rebuild (as an object of a class defined in a
    ``file.py`` module the worker alone imported)."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> None:
    raise RuntimeError("cannot be rebuilt here")


def pool_handler() -> Any:
    """A TaskPool handler factory: ``"unreadable"`` -> :class:`Unreadable`, ``("sleep", s)`` -> sleeps ``s``
    seconds, anything else comes back as it is."""

    def handle(task: Any) -> Any:
        if task == "unreadable":
            return Unreadable()
        if isinstance(task, tuple) and task[0] == "sleep":
            time.sleep(task[1])
            return "slept"
        return task

    return handle
