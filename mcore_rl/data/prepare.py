"""Public math datasets into verl's columns (``mcore-rl data prepare {gsm8k,math}``), from a local copy, as
verl's ``examples/data_preprocess/gsm8k.py`` and ``math_dataset.py`` do from the hub::

    gsm8k  {"question": "...", "answer": "... #### 1,234"}              (openai/gsm8k, config main)
    math   {"problem": "...", "solution": "... \\boxed{\\frac{1}{2}} ..."}   (DigitalLearningGmbH/MATH-lighteval)
      -> {"data_source": "openai/gsm8k" | "DigitalLearningGmbH/MATH-lighteval",
          "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
          "ability": "math",
          "reward_model": {"style": "rule", "ground_truth": "1234" | "\\frac{1}{2}"},
          "extra_info": {"split": "train", "index": 0, ...}}      # gsm8k also keeps question and answer
      -> <out>/<split>.parquet  (train.parquet, test.parquet: verl's names)

The ground truth is what verl extracts: the number after the first ``#### `` with its commas removed, the
content of the last ``\\boxed{}`` (or ``\\fbox{}``, or ``\\boxed x``). Those are what the GSM8K and MATH rules
of ``mcore_rl/scoring/rules.py`` compare against, so the data sources dispatch to them unchanged.

Each input file holds one split: named ``split=path``, else ``--split``, else read from the file name
(``train*`` or ``test*``, as the hub's ``main/train-00000-of-00001.parquet``); a folder stands for the data
files under it. Files of one split are concatenated in order (``index`` counts rows within the split).
A row that cannot be converted stops the run naming the file, the row and the column; the output folder
appears complete or not at all and is never written over (:class:`~mcore_rl.io.output.OutputFolder`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.rows import DataError, RowProblem, read_rows
from mcore_rl.io.errors import InputError, OutputError
from mcore_rl.io.output import OutputFolder

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
SPLITS = ("train", "test")


class PrepareError(DataError, InputError):
    """An input of ``data prepare`` that cannot be converted; the message names the file (and row, column)."""


@dataclass(frozen=True)
class Task:
    """One public dataset's layout and the verl columns it becomes."""

    data_source: str
    """``data_source`` of the written rows (picks the scorer)."""
    instruction: str
    """Appended to the question after one space (verl's ``instruction_following``)."""
    question_key: str
    answer_key: str
    ground_truth: Callable[[str], str | None]
    """The reference answer in the answer text, or None when it has none."""
    lacks: str
    """What an answer without a ground truth lacks, in words."""
    keep_text: bool
    """Keep the raw question and answer in ``extra_info`` (verl's GSM8K script does)."""


_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_ground_truth(answer: str) -> str | None:
    """verl's ``extract_solution``: the number after the first ``#### ``, commas removed."""
    found = _GSM8K_FINAL.search(answer)
    return None if found is None else found.group(1).replace(",", "")


def boxed_ground_truth(solution: str) -> str | None:
    """verl's ``remove_boxed(last_boxed_only_string(solution))``: the content of the last ``\\boxed{...}`` or
    ``\\fbox{...}`` (braces balanced), or the token of ``\\boxed x``; None when there is none."""
    start = solution.rfind("\\boxed")
    if start < 0:
        start = solution.rfind("\\fbox")
    if start < 0:
        return None
    rest = solution[start:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed ") :].split("$")[0] or None
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[open_at + 1 : i]
    return None  # unbalanced braces: no answer


TASKS = {
    "gsm8k": Task(
        data_source="openai/gsm8k",
        instruction='Let\'s think step by step and output the final answer after "####".',
        question_key="question",
        answer_key="answer",
        ground_truth=gsm8k_ground_truth,
        lacks="no final answer '#### <number>'",
        keep_text=True,
    ),
    "math": Task(
        data_source="DigitalLearningGmbH/MATH-lighteval",
        instruction="Let's think step by step and output the final answer within \\boxed{}.",
        question_key="problem",
        answer_key="solution",
        ground_truth=boxed_ground_truth,
        lacks="no \\boxed{...} answer",
        keep_text=False,
    ),
}


def verl_row(task: Task, raw: Any, file: str, row: int, split: str, index: int) -> dict[str, Any]:
    """One input row as a verl row; :class:`PrepareError` naming file, row and column when it cannot be."""
    if isinstance(raw, RowProblem):
        raise PrepareError(str(raw))
    if not isinstance(raw, dict):
        raise PrepareError(str(RowProblem(file, row, "<row>", f"expected an object, got {raw!r:.60}")))
    text = {}
    for key in (task.question_key, task.answer_key):
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            reason = "missing" if value is None else f"expected non-empty text, got {value!r:.60}"
            raise PrepareError(str(RowProblem(file, row, key, reason)))
        text[key] = value
    truth = task.ground_truth(text[task.answer_key])
    if truth is None or not truth.strip():
        raise PrepareError(str(RowProblem(file, row, task.answer_key, task.lacks)))
    question = text[task.question_key]
    extra: dict[str, Any] = {"split": split, "index": index}
    if task.keep_text:
        extra.update(answer=text[task.answer_key], question=question)
    return {
        "data_source": task.data_source,
        "prompt": [{"role": "user", "content": f"{question} {task.instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def split_inputs(inputs: Sequence[str], split: str | None = None) -> dict[str, list[str]]:
    """``[split=]path`` inputs -> split -> data files in order (a folder: its data files, sorted)."""
    if split is not None and split not in SPLITS:
        raise PrepareError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    out: dict[str, list[str]] = {}
    for given in inputs:
        named, path = _named_input(given)
        for file in _data_files(path):
            which = named or split or _split_of_name(file)
            if which is None:
                raise PrepareError(
                    f"--input {file}: which split is it? Name it (--input train={file}) or pass "
                    f"--split {'|'.join(SPLITS)}"
                )
            out.setdefault(which, []).append(file)
    if not out:
        raise PrepareError("no --input given")
    return out


def _named_input(given: str) -> tuple[str, str]:
    """``[split=]path`` -> (split or "", path)."""
    named, sep, path = given.partition("=")
    return (named, path) if sep and named in SPLITS else ("", given)


def _data_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise PrepareError(f"--input {path}: no such file or folder")
    found = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith(DATA_SUFFIXES) and not name.startswith(".")
    )
    if not found:
        raise PrepareError(f"--input {path}: a folder with no {', '.join(DATA_SUFFIXES)} files")
    return found


def _split_of_name(file: str) -> str | None:
    name = os.path.basename(file).lower()
    return next((s for s in SPLITS if name.startswith(s)), None)


def convert_split(task: Task, files: Sequence[str], split: str) -> list[dict[str, Any]]:
    """Every row of ``files`` (one split, in order) as verl rows; the first bad row stops it."""
    rows: list[dict[str, Any]] = []
    for file in files:
        try:
            read = list(read_rows(file))
        except DataError as err:
            raise PrepareError(str(err)) from None
        rows += [verl_row(task, raw, file, row, split, len(rows) + i) for i, (row, raw) in enumerate(read)]
    if not rows:
        raise PrepareError(f"{', '.join(files)}: no rows")
    return rows


@dataclass(frozen=True)
class Prepared:
    """What ``data prepare`` wrote."""

    folder: str
    files: dict[str, str]
    """split -> the parquet file written."""
    num_rows: dict[str, int]
    """split -> rows written."""


def prepare_dataset(name: str, inputs: Sequence[str], out: str, split: str | None = None) -> Prepared:
    """Convert ``inputs`` (``[split=]path``, see the module docstring) of the public dataset ``name`` into
    ``out/<split>.parquet``; every row is converted before anything is written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if name not in TASKS:
        raise PrepareError(f"unknown dataset {name!r}; choose one of {', '.join(TASKS)}")
    task, by_split = TASKS[name], split_inputs(inputs, split)
    if os.path.isdir(out) and os.listdir(out):
        raise OutputError(f"--out {out} exists and is not empty; prepared data is never written over it")
    # the folders given as well as their files: an output inside an input folder would be read back as input
    sources = [*(_named_input(g)[1] for g in inputs), *(f for files in by_split.values() for f in files)]
    output = OutputFolder.plan(out, flag="--out", inputs=sources, kind="dataset")
    tables = {s: pa.Table.from_pylist(convert_split(task, files, s)) for s, files in by_split.items()}
    staging = output.begin()
    try:
        for which, table in tables.items():
            pq.write_table(table, os.path.join(staging, f"{which}.parquet"))
        output.commit()
    except BaseException:
        output.abort()
        raise
    return Prepared(
        output.path,
        {s: os.path.join(output.path, f"{s}.parquet") for s in tables},
        {s: t.num_rows for s, t in tables.items()},
    )
