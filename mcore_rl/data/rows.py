"""Reading verl-format rows from jsonl and parquet files, and pulling the columns a run needs out of them.

A verl row (``examples/data_preprocess/gsm8k.py``)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],        # or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Every problem with a row is a :class:`DataError` naming file, row (0-based, as pandas/pyarrow count; in a
line-based file, the line index: blank lines count) and column; the caller decides between stopping and a
counted skip. A ``.json`` file is a JSON array of rows or
one row per line (``datasets``' ``to_json`` writes lines).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mcore_rl.io.errors import InputError


class DataError(InputError):
    """A dataset file or row we cannot use; the message names the file, the row and the column."""


@dataclass(frozen=True)
class RowProblem:
    """Where a row went wrong (kept for counted skips)."""

    file: str
    row: int
    column: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: row {self.row}: column {self.column!r}: {self.reason}"


def read_rows(path: str) -> Iterator[tuple[int, Any]]:
    """``(row number, row)`` pairs of a ``.jsonl`` / ``.json`` (a JSON array, or one object per line) or
    ``.parquet`` file; a line-based file's row number is its 0-based line index (blank lines count)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file")
    if path.endswith(".json") and _starts_with(path, b"["):
        yield from enumerate(_json_array(path))
        return
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable parquet file ({err})") from None
        yield from enumerate(table.to_pylist())
    elif path.endswith((".jsonl", ".json")):
        with open(path, "rb") as f:  # decoded line by line, so bad bytes are named by their row
            for row, raw in enumerate(f):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    reason = f"not UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start} of the line)"
                    yield row, RowProblem(path, row, "<line>", reason)
                    continue
                if not line.strip():
                    continue
                try:
                    yield row, json.loads(line)
                except json.JSONDecodeError as err:
                    yield row, RowProblem(path, row, "<line>", f"not valid JSON ({err.msg})")
    else:
        raise DataError(f"{path}: unknown data format; use .parquet, .jsonl or .json")


def _starts_with(path: str, prefix: bytes) -> bool:
    """The file's first non-blank bytes are ``prefix`` (a JSON array opens with ``[``)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 byte-order mark, whitespace
    return head.startswith(prefix)


def _json_array(path: str) -> list[Any]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a valid JSON array of rows ({err})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON array of rows")
    return rows


def column_in_file(path: str, dotted: str) -> bool:
    """Some row of ``path`` holds ``dotted`` (not null): a column every row lacks is a wrong key to name,
    not rows to skip one by one."""
    return any(has_column(row, dotted) for _, row in read_rows(path))


def refuse_a_column_no_row_has(
    problem: RowProblem, raw: Any, present: set[str], fixes: dict[str, str]
) -> None:
    """Raise when ``problem`` is a column missing from every row of its file: a wrong key, named with the
    columns the file has and ``fixes[column]`` (what to set); said row by row, the advice to skip bad rows
    skipped them all. ``present`` caches the columns some row of the file holds (one read per column)."""
    if problem.reason != "missing" or not isinstance(raw, dict) or problem.column in present:
        return
    if column_in_file(problem.file, problem.column):
        present.add(problem.column)
        return
    columns = ", ".join(file_columns(problem.file)) or "none"
    raise DataError(
        f"{problem.file}: no row has column {problem.column!r} (its columns: {columns}); "
        f"{fixes.get(problem.column, 'check the file')}"
    )


def file_columns(path: str) -> list[str]:
    """The top-level columns the rows of ``path`` hold, in first-seen order (for messages)."""
    seen: dict[str, None] = {}
    for _, row in read_rows(path):
        if isinstance(row, dict):
            seen.update(dict.fromkeys(map(str, row)))
    return list(seen)


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Write rows as ``.parquet`` or ``.jsonl`` (by suffix), through a staging name."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    staging = path + ".tmp"
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), staging)
    elif path.endswith(".jsonl"):
        with open(staging, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        raise DataError(f"{path}: unknown data format; use .parquet or .jsonl")
    os.replace(staging, path)


def column(row: Any, dotted: str, where: tuple[str, int]) -> Any:
    """The value at ``dotted`` (e.g. ``reward_model.ground_truth``); :class:`RowProblem` when absent/null."""
    if isinstance(row, RowProblem):
        raise BadRowError(row)
    value = _lookup(row, dotted)
    if value is None:
        raise BadRowError(RowProblem(where[0], where[1], dotted, "missing"))
    return value


def has_column(row: Any, dotted: str) -> bool:
    """``row`` holds ``dotted``, not null: :func:`column` would return it."""
    return _lookup(row, dotted) is not None


def _lookup(row: Any, dotted: str) -> Any:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def prompt_messages(value: Any, key: str, where: tuple[str, int]) -> str | list[dict[str, Any]]:
    """A prompt column: plain text, or a list of ``{role, content}`` messages, each keeping its other fields
    (an assistant turn's ``tool_calls``, a tool's ``name``: the chat template renders them; null ones, as a
    parquet struct column gives every message, are dropped)."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRowError(RowProblem(where[0], where[1], key, "empty prompt"))
        return value
    if isinstance(value, list) and value:
        messages = []
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise BadRowError(
                    RowProblem(where[0], where[1], key, f"message {i} needs 'role' and 'content'")
                )
            content = message_text(message["content"])
            if content is None or not isinstance(message["role"], str):
                reason = f"message {i}: expected a role and text content, got {message!r:.80}"
                raise BadRowError(RowProblem(where[0], where[1], key, reason))
            others = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
            messages.append({**others, "role": message["role"], "content": content})
        if not any(m["content"].strip() for m in messages):
            raise BadRowError(RowProblem(where[0], where[1], key, "empty prompt (every message is empty)"))
        return messages
    if isinstance(value, list):
        raise BadRowError(RowProblem(where[0], where[1], key, "empty prompt (no messages)"))
    raise BadRowError(
        RowProblem(where[0], where[1], key, f"expected text or a list of messages, got {value!r:.60}")
    )


def message_text(content: Any) -> str | None:
    """A message's content as text: a string, or OpenAI's content parts when every part is text
    (``[{"type": "text", "text": ...}, ...]``, joined); None for anything else (null, an image part)."""
    if isinstance(content, str):
        return content
    is_sequence = isinstance(content, list | tuple) or type(content).__name__ == "ndarray"  # pandas' parquet
    parts = list(content) if is_sequence else []
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    if parts and len(texts) == len(parts) and all(isinstance(t, str) for t in texts):
        return "".join(str(t) for t in texts)
    return None


class BadRowError(Exception):
    """A bad row, raised by the column helpers with its :class:`RowProblem`; datasets stop or count it."""

    def __init__(self, error: RowProblem) -> None:
        super().__init__(str(error))
        self.error = error
