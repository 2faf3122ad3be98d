"""Labelled examples for supervised fine-tuning: a prompt (as in RL data) plus the target response.

Tokens are ``prompt + response + EOS``; the loss mask covers the positions that predict the response and
EOS only (prompt tokens are never a target). A response may also be a multi-turn trace, a list of chat
messages after the prompt (``assistant`` turns, with tool calls as the model writes them, and the ``tool``
or ``user`` turns that answer them): its tokens are those a multi-turn rollout of the same turns holds
(``chat_format.conversation_ids``) and only the assistant's tokens and stop tokens are targets.

Two row layouts are read (the column names are settings, defaults here):

- ``prompt`` (``data.prompt_key``) plus ``response`` (``sft.response_key``), as above;
- ``messages`` (``sft.messages_key``), one chat list as verl's multi-turn SFT, TRL and NeMo-RL keep it: the
  turns before the first ``assistant`` turn are the prompt (a user turn among them), the rest is a multi-turn
  response trace, so every assistant turn is a target and the user or tool turns between them are not.

A row holding both reads ``prompt`` + ``response``; a row with ``prompt`` but no ``response`` reads its
``messages`` (HF chat sets such as UltraChat keep the first user turn as ``prompt`` beside the chat).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.data.chat_format import chat_format_of, conversation_ids
from mcore_rl.data.config import DataConfig
from mcore_rl.data.prompts import encode_prompt
from mcore_rl.data.rows import (
    BadRowError,
    DataError,
    RowProblem,
    column,
    has_column,
    message_text,
    prompt_messages,
    read_rows,
)
from mcore_rl.data.sampler import EpochSampler
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.io.errors import InputError
from mcore_rl.types import SFTBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTRecord:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    """Target tokens, EOS included."""
    target_mask: tuple[int, ...] | None = None
    """Multi-turn traces: 1 on the response tokens that are targets (the assistant's), 0 on the rest (tool
    answers, turn markers); None: every response token is a target."""


def sft_batch(records: Sequence[SFTRecord], pad_token_id: int) -> SFTBatch:
    """The records as right-padded next-token training rows."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in records)
    tokens = torch.full((len(records), width), pad_token_id, dtype=torch.long)
    labels = torch.full_like(tokens, pad_token_id)
    mask = torch.zeros(len(records), width)
    for i, r in enumerate(records):
        seq = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
        tokens[i, : len(seq)] = seq
        labels[i, : len(seq) - 1] = seq[1:]
        targets = torch.ones(len(r.response_ids)) if r.target_mask is None else torch.tensor(r.target_mask)
        mask[i, len(r.prompt_ids) - 1 : len(seq) - 1] = targets.float()
    return SFTBatch(tokens, labels, mask)


class SFTDataset:
    def __init__(self, records: Sequence[SFTRecord], pad_token_id: int) -> None:
        self.records = list(records)
        self.pad_token_id = pad_token_id

    @classmethod
    def from_files(
        cls,
        files: Sequence[str],
        tokenizer: Tokenizer,
        data: DataConfig,
        response_key: str = "response",
        max_length: int | None = None,
        messages_key: str = "messages",
    ) -> SFTDataset:
        max_length = max_length or data.max_prompt_length + data.max_response_length
        columns = SFTColumns(data.prompt_key, response_key, messages_key)
        records, skipped = [], []
        for file in files:
            for row, raw in _rows_with_a_layout(file, columns):
                try:
                    records.append(_record(raw, (file, row), tokenizer, columns, data, max_length))
                except BadRowError as bad:
                    overlong = bad.error.reason.startswith("example has")
                    if not (records or data.skip_bad_rows) and _no_response_column(
                        bad.error, raw, response_key
                    ):
                        raise DataError(
                            f"{bad.error}: the rows hold no sft.response_key={response_key!r}; name the column "
                            f"of the answer text (e.g. sft.response_key=extra_info.answer for the files of "
                            f"`mcore-rl data prepare`; columns here: {', '.join(sorted(raw))}; or data.skip_bad_rows=true "
                            "if only some rows lack it)"
                        ) from None
                    if not (data.filter_overlong_prompts if overlong else data.skip_bad_rows):
                        hint = "data.filter_overlong_prompts" if overlong else "data.skip_bad_rows"
                        raise DataError(f"{bad.error} (set {hint}=true to skip such rows)") from None
                    skipped.append(bad.error)
        if skipped:
            log.warning("skipped %d SFT rows; first: %s", len(skipped), skipped[0])
        if not records:
            first = f" (every row skipped, the first: {skipped[0]})" if skipped else ""
            raise DataError(f"{', '.join(files) or 'no files'}: no usable SFT examples{first}")
        return cls(records, tokenizer.pad_token_id)

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: Sequence[int]) -> SFTBatch:
        return sft_batch([self.records[i] for i in indices], self.pad_token_id)

    def sampler(self, batch_size: int, seed: int) -> EpochSampler:
        """Shuffled batches of ``batch_size`` examples (state saved like the prompt loader's)."""
        return EpochSampler(len(self), batch_size, True, seed, True, f"sft:{len(self)}")


@dataclass(frozen=True)
class SFTColumns:
    """Where an SFT row keeps its example: ``prompt`` + ``response``, or one ``messages`` chat list."""

    prompt: str
    response: str
    messages: str


def _rows_with_a_layout(file: str, columns: SFTColumns) -> Iterator[tuple[int, Any]]:
    """The rows of ``file``, refused as a whole when no row holds the prompt or the messages column: a wrong
    key or another format, not rows to skip one by one. Rows before the first holding one wait for it, so a
    file that never shows one is named before any of its rows is."""
    waiting: list[tuple[int, Any]] | None = []  # None once a row has shown a layout
    seen: set[str] = set()
    for row, raw in read_rows(file):
        if waiting is None:
            yield row, raw
        elif has_column(raw, columns.prompt) or has_column(raw, columns.messages):
            yield from waiting
            yield row, raw
            waiting = None
        else:
            waiting.append((row, raw))
            seen |= set(raw) if isinstance(raw, dict) else set()
    if waiting and seen:
        raise DataError(
            f"{file}: no row holds {columns.prompt!r} or {columns.messages!r}; it has columns "
            f"{', '.join(sorted(seen))}: SFT reads data.prompt_key {columns.prompt!r} with sft.response_key "
            f"{columns.response!r}, or a chat list in sft.messages_key {columns.messages!r}"
        )
    yield from waiting or ()  # rows that are not objects (bad JSON) name their own problem


def _no_response_column(problem: RowProblem, raw: Any, response_key: str) -> bool:
    """The first row has no ``response_key``: most likely a wrong key rather than one bad row to skip."""
    return isinstance(raw, dict) and (problem.column, problem.reason) == (response_key, "missing")


def _record(
    raw: Any,
    where: tuple[str, int],
    tokenizer: Tokenizer,
    columns: SFTColumns,
    data: DataConfig,
    max_length: int,
) -> SFTRecord:
    prompt, response, response_key = _example(raw, where, columns)
    prompt_ids = encode_prompt(prompt, tokenizer, data.apply_chat_template)
    target_mask = None
    if _is_trace(response):
        response_ids, target_mask = _trace_ids(response, prompt_ids, tokenizer, (*where, response_key))
    elif not isinstance(response, str) or not response:
        raise BadRowError(RowProblem(*where, response_key, f"expected non-empty text, got {response!r:.60}"))
    else:
        response_ids = tokenizer.encode(response)
        if not response_ids or response_ids[-1] != tokenizer.eos_token_id:  # one stop token, as DPO and TRL
            response_ids.append(tokenizer.eos_token_id)
    total = len(prompt_ids) + len(response_ids)
    if total > max_length:
        raise BadRowError(
            RowProblem(*where, response_key, f"example has {total} tokens, more than {max_length}")
        )
    return SFTRecord(
        tuple(prompt_ids), tuple(response_ids), None if target_mask is None else tuple(target_mask)
    )


def _example(raw: Any, where: tuple[str, int], columns: SFTColumns) -> tuple[Any, Any, str]:
    """``(prompt, response, the column a problem with the response is reported under)`` in the row's layout."""
    if isinstance(raw, RowProblem):
        raise BadRowError(raw)
    prompt_layout = has_column(raw, columns.prompt) and has_column(raw, columns.response)
    if not prompt_layout and has_column(raw, columns.messages):
        prompt, trace = _split_chat(column(raw, columns.messages, where), columns.messages, where)
        return prompt, trace, columns.messages
    if not has_column(raw, columns.prompt):
        reason = f"missing, and no chat list in {columns.messages!r} either"
        raise BadRowError(RowProblem(*where, columns.prompt, reason))
    prompt = prompt_messages(column(raw, columns.prompt, where), columns.prompt, where)
    return prompt, column(raw, columns.response, where), columns.response


def _split_chat(chat: Any, key: str, where: tuple[str, int]) -> tuple[Any, list[dict[str, Any]]]:
    """A chat list as (prompt, trace): the turns before its first assistant turn, and that turn on."""
    if not isinstance(chat, list):
        raise BadRowError(RowProblem(*where, key, f"expected a list of chat messages, got {chat!r:.60}"))
    for i, turn in enumerate(chat):
        # parquet gives a message without a field that field as null
        if not isinstance(turn, dict) or turn.get("role") is None or turn.get("content") is None:
            reason = f"message {i} needs 'role' and 'content', got {turn!r:.80}"
            raise BadRowError(RowProblem(*where, key, reason))
    roles = [turn["role"] for turn in chat]
    if "assistant" not in roles:
        raise BadRowError(RowProblem(*where, key, "no assistant turn to train on"))
    first = roles.index("assistant")
    if first == 0:
        raise BadRowError(RowProblem(*where, key, "starts with an assistant turn: no prompt turn before it"))
    if "user" not in roles[:first]:
        reason = f"no user turn before the first assistant turn (roles {roles[: first + 1]})"
        raise BadRowError(RowProblem(*where, key, reason))
    return prompt_messages(chat[:first], key, where), chat[first:]


def _is_trace(response: Any) -> bool:
    """A multi-turn trace: a list of chat messages (parquet may hand back a numpy array of them)."""
    return hasattr(response, "__len__") and not isinstance(response, str | dict) and len(response) > 0


def _trace_ids(
    response: Any, prompt_ids: list[int], tokenizer: Tokenizer, where: tuple[str, int, str]
) -> tuple[list[int], list[int]]:
    turns = []
    for turn in response:
        if not isinstance(turn, dict) or turn.get("role") not in ("assistant", "tool", "user"):
            raise BadRowError(
                RowProblem(*where, f"expected messages with role assistant, tool or user, got {turn!r:.60}")
            )
        content = message_text(turn.get("content", ""))
        if content is None:
            raise BadRowError(RowProblem(*where, f"expected a message with text content, got {turn!r:.60}"))
        others = {k: v for k, v in turn.items() if k not in ("role", "content") and v is not None}
        if turn["role"] == "assistant" and len(others.get("tool_calls", ())):
            # The assistant's tokens are its content as the model writes it; structured calls were dropped
            # (the turn trained as a bare stop token).
            raise BadRowError(
                RowProblem(
                    *where,
                    "an assistant turn's tool_calls: write the calls in its content as the model emits them",
                )
            )
        # what answers the assistant keeps its fields (a tool's name, tool_call_id): the template renders them
        turns.append(
            {"role": turn["role"], "content": content, **({} if turn["role"] == "assistant" else others)}
        )
    if turns[0]["role"] != "assistant":
        raise BadRowError(RowProblem(*where, "a multi-turn response starts with an assistant turn"))
    try:
        return conversation_ids(tokenizer, chat_format_of(tokenizer), prompt_ids, turns)
    except InputError as err:
        raise BadRowError(RowProblem(*where, str(err))) from None
