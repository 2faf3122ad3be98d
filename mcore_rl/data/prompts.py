"""Prompt datasets for RL: verl-format rows -> tokenized :class:`PromptRecord`s -> :class:`PromptBatch`es.

Loading is eager (prompts are small; the tokenized set is the unit the sampler shuffles and the
fingerprint covers). Rows missing a needed column and prompts over ``max_prompt_length`` either stop the
load with the file, row and column, or are skipped and counted in one warning, per ``DataConfig``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.data.config import DataConfig
from mcore_rl.data.rows import (
    BadRowError,
    DataError,
    RowProblem,
    column,
    prompt_messages,
    read_rows,
    refuse_a_column_no_row_has,
)
from mcore_rl.data.sampler import EpochSampler
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.types import PromptBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRecord:
    """One usable prompt."""

    prompt_ids: tuple[int, ...]
    """Token ids of the rendered prompt (chat template applied)."""
    data_source: str
    """Picks the reward function (``DataConfig.reward_fn_key``)."""
    ground_truth: Any
    """``reward_model.ground_truth``: only the scorer sees it."""
    extra_info: dict[str, Any]
    """``extra_info`` as stored (an empty dict when absent)."""
    messages: tuple[dict[str, Any], ...]
    """The prompt as chat messages (:func:`opening_messages`), for multi-turn conversations; the model reads
    ``prompt_ids``."""
    file: str
    row: int
    """Where the prompt came from (0-based row), for error messages and debugging."""


class PromptDataset:
    """Tokenized prompts of one or more files, in file order."""

    def __init__(self, records: Sequence[PromptRecord], skipped: Sequence[RowProblem] = ()) -> None:
        self.records = list(records)
        self.skipped = list(skipped)
        """Rows dropped (bad or over-long) with the reason of each."""

    def source_origins(self) -> dict[str, str]:
        """Each ``data_source`` of the prompts -> where its first row is (``file row N``), for messages."""
        found: dict[str, str] = {}
        for r in self.records:
            found.setdefault(r.data_source, f"{r.file} row {r.row}")
        return found

    @classmethod
    def from_files(
        cls, files: Sequence[str], tokenizer: Tokenizer, cfg: DataConfig, check: RowCheck | None = None
    ) -> PromptDataset:
        """Every usable prompt of ``files``; ``check(data_source, ground_truth, extra_info)`` says which field of a
        row is wrong for its scorer and why (the scorers' own rules, given by the caller: data knows no scorer),
        or None."""
        records: list[PromptRecord] = []
        skipped: list[RowProblem] = []
        for file in files:
            present: set[str] = set()  # columns some row of this file is known to hold
            for row, raw in read_rows(file):
                try:
                    records.append(_checked(_record(raw, file, row, tokenizer, cfg), check))
                except BadRowError as bad:
                    _no_such_column(bad.error, raw, cfg, present)
                    overlong = bad.error.reason.startswith("prompt has")
                    if not (cfg.filter_overlong_prompts if overlong else cfg.skip_bad_rows):
                        hint = "data.filter_overlong_prompts" if overlong else "data.skip_bad_rows"
                        raise DataError(f"{bad.error} (set {hint}=true to skip such rows)") from None
                    skipped.append(bad.error)
        if skipped:
            log.warning(
                "skipped %d of %d rows of %s; first: %s",
                len(skipped),
                len(skipped) + len(records),
                ", ".join(files),
                skipped[0],
            )
        if not records:
            raise DataError(f"{', '.join(files) or 'no files'}: no usable prompts")
        return cls(records, skipped)

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        picked = [self.records[i] for i in indices]
        return PromptBatch(
            prompt_ids=[list(r.prompt_ids) for r in picked],
            indices=torch.tensor(list(indices), dtype=torch.long),
            data_sources=[r.data_source for r in picked],
            ground_truths=[r.ground_truth for r in picked],
            extra_infos=[r.extra_info for r in picked],
            origins=[f"{r.file} row {r.row}" for r in picked],
            messages=[list(r.messages) for r in picked],
        )

    def fingerprint(self) -> str:
        """A hash of every prompt's tokens and ground truth: a resumed run refuses a changed dataset."""
        digest = hashlib.sha256()
        for r in self.records:
            digest.update(_content(r))
        return digest.hexdigest()[:16]

    def manifest(self) -> dict[str, Any]:
        """What a run checkpoint keeps of the data, enough to name what changed when a resume finds other data:
        per file, in order, its usable prompts and a 32-bit digest of each (8 hex characters a prompt, of what
        :meth:`fingerprint` covers)."""
        files: dict[str, list[str]] = {}
        for r in self.records:
            files.setdefault(r.file, []).append(hashlib.sha256(_content(r)).hexdigest()[:8])
        return {"files": [{"file": f, "prompts": len(d), "digests": "".join(d)} for f, d in files.items()]}

    def describe_change(self, saved: dict[str, Any]) -> str:
        """What differs between this data and the :meth:`manifest` a checkpoint saved: files added, removed or
        reordered, a file's prompt count, the first row that differs."""
        now = self.manifest()["files"]
        before = {f["file"]: f for f in saved.get("files", [])}
        names, saved_names = [f["file"] for f in now], list(before)
        added, removed = [n for n in names if n not in before], [n for n in saved_names if n not in names]
        if added or removed:
            change = [
                f"added {', '.join(added)}" if added else "",
                f"removed {', '.join(removed)}" if removed else "",
            ]
            return "the files changed: " + "; ".join(c for c in change if c)
        if names != saved_names:
            return f"the files are in another order (saved: {', '.join(saved_names)})"
        rows: dict[str, list[int]] = {}
        for r in self.records:
            rows.setdefault(r.file, []).append(r.row)
        changes = [_file_change(f["file"], before[f["file"]], f, rows[f["file"]]) for f in now]
        return "; ".join(c for c in changes if c) or "the prompts differ"


def _content(r: PromptRecord) -> bytes:
    return json.dumps([r.prompt_ids, r.data_source, r.ground_truth], default=str).encode()


def _file_change(file: str, saved: dict[str, Any], now: dict[str, Any], rows: list[int]) -> str | None:
    """One file's change, or None: its prompt count and the first prompt that differs (by its row now)."""
    old, new = str(saved.get("digests", "")), str(now["digests"])
    old_digests = [old[i : i + 8] for i in range(0, len(old), 8)]
    new_digests = [new[i : i + 8] for i in range(0, len(new), 8)]
    differ = [i for i, (a, b) in enumerate(zip(old_digests, new_digests, strict=False)) if a != b]
    count = ""
    if len(old_digests) != len(new_digests):
        count = f"{len(old_digests)} usable prompts when saved, {len(new_digests)} now"
    if not differ:
        if not count:
            return None
        common = min(len(old_digests), len(new_digests))
        end = f"rows from {rows[common]} added" if common < len(rows) else "the last ones removed"
        return f"{file}: {count} ({end})"
    if len(differ) == min(len(old_digests), len(new_digests)) > 1:
        what = "every prompt differs (a changed tokenizer, chat template or data.prompt_key?)"
    else:
        what = f"row {rows[differ[0]]} is the first prompt that differs ({len(differ)} differ)"
    return f"{file}: " + ", ".join(w for w in (count, what) if w)


def encode_prompt(prompt: str | list[dict[str, str]], tokenizer: Tokenizer, chat_template: bool) -> list[int]:
    """Plain text as the tokenizer encodes a text on its own (its BOS first where it adds one: Llama's); messages
    through the chat template, which writes its own (or their joined contents, as plain text, when it is off)."""
    if not isinstance(prompt, str) and chat_template:
        return tokenizer.encode(tokenizer.chat_text(prompt, add_generation_prompt=True))
    text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    return [*tokenizer.text_prefix, *tokenizer.encode(text)]


def opening_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt column as the chat messages a conversation starts with (verl's ``raw_prompt``, NeMo-RL's
    ``message_log``): the row's own messages, plain text as one ``user`` message. Whatever :func:`encode_prompt`
    made of it (template or joined text), an environment reads the row's messages."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


RowCheck = Callable[[str, Any, dict[str, Any]], "tuple[str, str] | None"]
"""``(data_source, ground_truth, extra_info) -> (field, problem) or None``: a row's fitness for its scorer."""


def _checked(record: PromptRecord, check: RowCheck | None) -> PromptRecord:
    found = None if check is None else check(record.data_source, record.ground_truth, record.extra_info)
    if found is not None:
        field, problem = found
        raise BadRowError(RowProblem(record.file, record.row, field, problem))
    return record


def _no_such_column(problem: RowProblem, raw: Any, cfg: DataConfig, present: set[str]) -> None:
    """A column missing from every row of the file is a wrong key, named with what to set."""
    fixes = {
        cfg.prompt_key: f"set data.prompt_key to the column of the prompt (now {cfg.prompt_key!r})",
        cfg.reward_fn_key: f"set data.reward_fn_key to the column naming each row's scorer (now "
        f"{cfg.reward_fn_key!r}; verl's rows hold data_source)",
        "reward_model.ground_truth": "RL rows hold the answer as reward_model.ground_truth, as verl's do "
        "(`mcore-rl data prepare` writes such files)",
    }
    refuse_a_column_no_row_has(problem, raw, present, fixes)


def _record(raw: Any, file: str, row: int, tokenizer: Tokenizer, cfg: DataConfig) -> PromptRecord:
    where = (file, row)
    prompt = prompt_messages(column(raw, cfg.prompt_key, where), cfg.prompt_key, where)
    data_source = column(raw, cfg.reward_fn_key, where)
    ground_truth = column(raw, "reward_model.ground_truth", where)
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise BadRowError(RowProblem(file, row, "extra_info", f"expected a mapping, got {extra_info!r:.60}"))
    ids = encode_prompt(prompt, tokenizer, cfg.apply_chat_template)
    if len(ids) > cfg.max_prompt_length:
        reason = f"prompt has {len(ids)} tokens, more than data.max_prompt_length={cfg.max_prompt_length}"
        raise BadRowError(RowProblem(file, row, cfg.prompt_key, reason))
    messages = tuple(opening_messages(prompt))
    return PromptRecord(tuple(ids), str(data_source), ground_truth, dict(extra_info), messages, file, row)


class PromptLoader:
    """Training batches of a :class:`PromptDataset`, reshuffled each epoch; see :class:`EpochSampler` for
    the saved position."""

    def __init__(self, dataset: PromptDataset, cfg: DataConfig) -> None:
        self.dataset = dataset
        self.sampler = EpochSampler(
            len(dataset), cfg.train_batch_size, cfg.shuffle, cfg.seed, cfg.drop_last, dataset.fingerprint()
        )

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> PromptBatch:
        return self.dataset.batch(self.sampler.next_indices())

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "data": self.dataset.manifest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; a state saved for other data is refused naming what changed (a checkpoint
        written before the manifest was kept names the fingerprints alone)."""
        saved = state.get("data")
        if state.get("fingerprint") != self.sampler.fingerprint and isinstance(saved, dict):
            raise DataError(
                f"cannot resume the data position: data.train_files changed since the checkpoint: "
                f"{self.dataset.describe_change(saved)}"
            )
        self.sampler.load_state_dict(state)
