"""Preference pairs for DPO: a prompt, a chosen and a rejected completion, tokenised and masked.

Rows (jsonl or parquet, the formats TRL and verl users have)::

    {"prompt": "123+456=", "chosen": "579", "rejected": "589"}                      # plain text
    {"prompt": [{"role": "user", "content": "..."}],                                # chat messages
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [...]}
    {"context": [...], "completions": [{"rank": 0, "completion": [...]},            # NeMo-RL's ranked
                                       {"rank": 1, "completion": [...]}]}             # rows (0 preferred)

A message-list completion continues the prompt's conversation: the completion text is what the tokenizer's
chat template adds to the prompt (``template(prompt + chosen)`` minus ``template(prompt, generation prompt)``),
less what the template writes after the last assistant turn (ChatML's ``<|im_end|>\n``), so the model is
trained on exactly the tokens it would generate, its stop token last. Plain-text completions are encoded as
they are. EOS closes every completion (unless it already ends with EOS).

Each pair becomes two right-padded rows, chosen and rejected; the loss mask covers the positions that predict
completion tokens, never the prompt. Prompts over ``data.max_prompt_length`` and pairs over the length limit
are dropped with one counted warning when ``data.filter_overlong_prompts`` is set (else refused, naming file,
row and column); bad rows follow ``data.skip_bad_rows`` the same way.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.data.chat_format import chat_format_of
from mcore_rl.data.config import DataConfig
from mcore_rl.data.prompts import encode_prompt
from mcore_rl.data.rows import (
    BadRowError,
    DataError,
    RowProblem,
    column,
    prompt_messages,
    read_rows,
    refuse_a_column_no_row_has,
)
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.io.errors import InputError

log = logging.getLogger(__name__)

Completion = str | list[dict[str, str]]


@dataclass(frozen=True)
class PreferenceRecord:
    """One tokenised pair; completions end with EOS."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


@dataclass
class PreferenceBatch:
    """``B`` pairs as ``2B`` right-padded rows: the chosen rows first, then the rejected ones in the same order
    (TRL's ``[chosen; rejected]`` layout), so row ``i`` and row ``B + i`` are one pair."""

    tokens: torch.Tensor  # [2B, S] int64: prompt + completion (EOS included), then padding
    loss_mask: torch.Tensor  # [2B, S] float32: 1 where the position predicts a completion token

    @property
    def num_pairs(self) -> int:
        return self.tokens.shape[0] // 2

    @classmethod
    def from_records(
        cls, records: Sequence[PreferenceRecord], pad_token_id: int, width_multiple: int = 1
    ) -> PreferenceBatch:
        """Rows of ``records``, padded to a common width rounded up to ``width_multiple`` (sequence
        parallelism splits positions over TP)."""
        sequences = [(r.prompt_ids, r.chosen_ids) for r in records] + [
            (r.prompt_ids, r.rejected_ids) for r in records
        ]
        width = max(len(p) + len(c) for p, c in sequences)
        width += -width % width_multiple
        tokens = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(sequences), width)
        for i, (prompt, completion) in enumerate(sequences):
            end = len(prompt) + len(completion)
            tokens[i, :end] = torch.tensor(prompt + completion, dtype=torch.long)
            mask[i, len(prompt) - 1 : end - 1] = 1.0  # position t predicts token t + 1
        return cls(tokens, mask)

    def pairs(self, start: int, stop: int) -> PreferenceBatch:
        """Pairs ``start:stop`` as a batch of their own (chosen and rejected rows stay together)."""
        b = self.num_pairs
        rows = torch.cat([torch.arange(start, stop), torch.arange(b + start, b + stop)])
        return PreferenceBatch(self.tokens[rows], self.loss_mask[rows])


class PreferenceDataset:
    """Tokenised pairs of one or more files, in file order."""

    def __init__(
        self,
        records: Sequence[PreferenceRecord],
        pad_token_id: int,
        num_dropped: dict[str, int] | None = None,
    ) -> None:
        self.records = list(records)
        self.pad_token_id = pad_token_id
        self.num_dropped = num_dropped or {"overlong": 0, "bad": 0}
        """Pairs dropped while reading, by reason (over-long, bad)."""

    @classmethod
    def from_files(
        cls,
        files: Sequence[str],
        tokenizer: Tokenizer,
        data: DataConfig,
        keys: tuple[str, str] = ("chosen", "rejected"),
        max_length: int | None = None,
    ) -> PreferenceDataset:
        """Read ``files``; ``keys`` are the chosen and rejected columns, ``max_length`` the longest prompt +
        completion (None: ``data.max_prompt_length + data.max_response_length``)."""
        limit = max_length or data.max_prompt_length + data.max_response_length
        records: list[PreferenceRecord] = []
        overlong: list[RowProblem] = []
        bad: list[RowProblem] = []
        for file in files:
            present: set[str] = set()  # columns some row of this file is known to hold
            for row, raw in read_rows(file):
                try:
                    records.append(_record(raw, (file, row), tokenizer, data, keys, limit))
                except BadRowError as err:
                    if not _is_ranked(raw, data.prompt_key):
                        refuse_a_column_no_row_has(
                            err.error, raw, present, _column_fixes(data.prompt_key, keys)
                        )
                    is_long = err.error.reason.startswith(("prompt has", "pair has"))
                    allowed = data.filter_overlong_prompts if is_long else data.skip_bad_rows
                    if not allowed:
                        hint = "data.filter_overlong_prompts" if is_long else "data.skip_bad_rows"
                        raise DataError(f"{err.error} (set {hint}=true to skip such rows)") from None
                    (overlong if is_long else bad).append(err.error)
        for what, problems in (("over-long", overlong), ("bad", bad)):
            if problems:
                log.warning("dropped %d %s preference pairs; first: %s", len(problems), what, problems[0])
        if not records:
            raise DataError(f"{', '.join(files) or 'no files'}: no usable preference pairs")
        return cls(records, tokenizer.pad_token_id, {"overlong": len(overlong), "bad": len(bad)})

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: Sequence[int], width_multiple: int = 1) -> PreferenceBatch:
        return PreferenceBatch.from_records(
            [self.records[i] for i in indices], self.pad_token_id, width_multiple
        )

    def fingerprint(self) -> str:
        """A digest of every token of every pair: a cache made for other data (or another tokenizer) is
        refused, not silently reused."""
        digest = hashlib.sha256()
        for r in self.records:
            digest.update(repr((r.prompt_ids, r.chosen_ids, r.rejected_ids)).encode())
        return digest.hexdigest()[:16]


def _column_fixes(prompt_key: str, keys: tuple[str, str]) -> dict[str, str]:
    """What to set when no row of a file has one of the columns a pair is read from."""
    ranked = "or give NeMo-RL's ranked rows (context + completions)"
    return {
        prompt_key: f"set data.prompt_key to the column of the prompt (now {prompt_key!r}), {ranked}",
        keys[0]: f"set dpo.chosen_key to the column of the preferred completion (now {keys[0]!r}), {ranked}",
        keys[1]: f"set dpo.rejected_key to the column of the other completion (now {keys[1]!r}), {ranked}",
    }


def _is_ranked(raw: Any, prompt_key: str) -> bool:
    """NeMo-RL's ranked layout (read by :func:`_from_ranked`) rather than prompt + chosen + rejected."""
    return isinstance(raw, dict) and prompt_key not in raw and {"context", "completions"} <= raw.keys()


def _record(
    raw: Any,
    where: tuple[str, int],
    tokenizer: Tokenizer,
    data: DataConfig,
    keys: tuple[str, str],
    max_length: int,
) -> PreferenceRecord:
    if _is_ranked(raw, data.prompt_key):
        raw = _from_ranked(raw, where, data.prompt_key, keys)
    prompt = prompt_messages(column(raw, data.prompt_key, where), data.prompt_key, where)
    prompt_ids = encode_prompt(prompt, tokenizer, data.apply_chat_template)
    if len(prompt_ids) > data.max_prompt_length:
        reason = (
            f"prompt has {len(prompt_ids)} tokens, more than data.max_prompt_length={data.max_prompt_length}"
        )
        raise BadRowError(RowProblem(*where, data.prompt_key, reason))
    completions = []
    for key in keys:
        value = prompt_messages(column(raw, key, where), key, where)
        completions.append(_completion_ids(prompt, value, tokenizer, data.apply_chat_template, (*where, key)))
    longest = len(prompt_ids) + max(len(c) for c in completions)
    if longest > max_length:
        reason = f"pair has {longest} tokens (prompt + longer completion), more than {max_length}"
        raise BadRowError(RowProblem(*where, keys[0], reason))
    return PreferenceRecord(tuple(prompt_ids), tuple(completions[0]), tuple(completions[1]))


def _from_ranked(
    raw: dict[str, Any], where: tuple[str, int], prompt_key: str, keys: tuple[str, str]
) -> dict[str, Any]:
    """NeMo-RL's ranked rows, ``{"context": [msgs], "completions": [{"rank": 0, "completion": [msgs]}, ...]}``
    with two completions (the lower rank is preferred), as a prompt/chosen/rejected row."""
    completions = raw["completions"]
    ranks = [c.get("rank") if isinstance(c, dict) else None for c in completions or []]
    if len(ranks) != 2 or not all(isinstance(r, int) for r in ranks) or ranks[0] == ranks[1]:
        reason = f"expected two completions with distinct integer ranks, got ranks {ranks}"
        raise BadRowError(RowProblem(*where, "completions", reason))
    chosen, rejected = sorted(completions, key=lambda c: c["rank"])
    return {
        prompt_key: raw["context"],
        keys[0]: chosen.get("completion"),
        keys[1]: rejected.get("completion"),
    }


def _completion_ids(
    prompt: Completion,
    completion: Completion,
    tokenizer: Tokenizer,
    chat_template: bool,
    where: tuple[str, int, str],
) -> list[int]:
    """Completion tokens, EOS-terminated; see the module docstring for message lists."""
    if isinstance(completion, str):
        text = completion
    elif isinstance(prompt, list) and chat_template:
        before = tokenizer.chat_text(prompt, add_generation_prompt=True)
        after = tokenizer.chat_text([*prompt, *completion], add_generation_prompt=False)
        if not after.startswith(before):
            reason = "the chat template does not render the prompt as a prefix of prompt + completion"
            raise BadRowError(RowProblem(*where, reason))
        text = _without_close(after[len(before) :], tokenizer, where)
    else:
        text = "".join(m["content"] for m in completion)
    ids = tokenizer.encode(text)
    if not ids:
        raise BadRowError(RowProblem(*where, "empty completion"))
    return ids if ids[-1] == tokenizer.eos_token_id else [*ids, tokenizer.eos_token_id]


def _without_close(text: str, tokenizer: Tokenizer, where: tuple[str, int, str]) -> str:
    """The completion's rendering without what the template writes after the last assistant turn's text
    (ChatML's ``<|im_end|>\n``): the model stops at its stop token, which the caller appends, and generates
    nothing after it, as an SFT example's response ends."""
    try:
        close = chat_format_of(tokenizer).close
    except InputError as err:
        raise BadRowError(RowProblem(*where, str(err))) from None
    return text[: -len(close)] if close and text.endswith(close) else text


# --- the synthetic preference task -----------------------------------------------------------------------------


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit replaced (never a leading zero): a near miss, so the pair differs in one
    position and the preference is about that digit, not about the answer's length."""
    position = rng.randrange(len(answer))
    low = 1 if position == 0 and len(answer) > 1 else 0
    digits = [d for d in "0123456789"[low:] if d != answer[position]]
    return answer[:position] + rng.choice(digits) + answer[position + 1 :]


def arithmetic_preference_rows(problems: Sequence[Any], seed: int) -> list[dict[str, Any]]:
    """Pairs preferring the correct sum over a wrong one, with the demo task's chat prompt."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": p.prompt}],
            "chosen": p.answer,
            "rejected": wrong_answer(p.answer, rng),
        }
        for p in problems
    ]


def prepare_preference_data(
    data: DataConfig, train_files: Sequence[str], val_files: Sequence[str], tokenizer_path: str | None
) -> list[str]:
    """For ``data.generate=arithmetic``: write the missing ``dpo.train_files`` / ``dpo.val_files`` (pairs
    from the demo task's train and validation problems), and the test prompts and tokenizer the demo task
    writes. Returns the files written."""
    import os

    from mcore_rl.data.demo_task import announce_generated, prepare_data, splits
    from mcore_rl.data.rows import write_rows

    if data.generate is None:
        return []
    written = prepare_data(data, tokenizer_path=tokenizer_path)
    wanted = {"train": list(train_files)[:1], "val": list(val_files)[:1]}
    missing = {split: paths[0] for split, paths in wanted.items() if paths and not os.path.isfile(paths[0])}
    if missing:
        problems = splits(data.seed, {"sft": 0})
        for split, path in missing.items():
            write_rows(path, arithmetic_preference_rows(problems[split], seed=data.seed + len(split)))
    pairs = {f"dpo.{split}_files pairs": path for split, path in missing.items()}
    return written + announce_generated(data.generate, pairs)
