"""Lines of the run's JSONL files (``metrics.jsonl``, ``generations.jsonl``): strict JSON, one record a line,
appended to by a resumed run."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: a non-finite number (an overflowed ratio, a scorer's inf) is
    written as null, where ``json.dumps`` wrote ``NaN`` / ``Infinity``, which JSON parsers refuse."""
    return json.dumps(_finite(record), allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def end_torn_line(path: str) -> None:
    """End the last line of ``path`` if a crash cut it short mid-write: what is appended next starts a line
    of its own (it was glued onto the torn one, and the resumed run's first record was lost with it)."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
