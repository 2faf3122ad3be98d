"""A multi-turn rollout's conversations as the records training reads, and its metrics.

A conversation is its prompt followed by segments: the model's turns (sampled, with their log-probs) and what
came back between them (tool answers, an environment's messages, the template's turn markers). Laid out as
one row of a :class:`~mcore_rl.types.RolloutBatch` (position-aligned: column ``t`` is about token ``t + 1``)::

    tokens          prompt | model turn 1 | tool turn | model turn 2 | pad
    response_mask   0 .. 0 | 1 ........ 1 | 0 ..... 0 | 1 ........ 1 | 0      (shifted one column left)

so the model's own tokens are the only ones with a loss, entropy, KL or agreement term; the rest is context.
``response_ids`` holds everything after the prompt (model and tool tokens: what ``score_text=response``
decodes), ``response_lengths`` its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.types import RolloutBatch

FINISHES = ("answered", "env_done", "max_turns", "length", "truncated", "env_error")
"""How a conversation ended: the model answered without a tool call; the environment said done; the last
allowed turn still called a tool (``max_assistant_turns``); a model turn reached the response budget; the next
tool or environment turn would not fit the response budget (cut there, logged); the environment failed."""


@dataclass
class Segment:
    ids: list[int]
    model: bool
    """Sampled by the model (trained on) rather than context."""
    log_probs: list[float] = field(default_factory=list)
    """The sampling policy's log-prob of each model token; empty for context."""


@dataclass
class Conversation:
    """One sample of a multi-turn rollout, as it grows."""

    row: int
    """Its row in the rollout (prompt-major) and its conversation id for the engine."""
    prompt_index: int
    prompt: list[int]
    extra_info: dict[str, Any]
    where: str
    """For messages: ``sample 5 (train.parquet row 17)``."""
    segments: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as chat messages: the dataset row's own (``PromptBatch.messages``: system, user, ...;
    the decoded prompt as one ``user`` message where a batch has none), then each model, tool and environment
    turn. What the environment's ``step`` reads and ``generations.jsonl`` records."""
    finish: str = ""
    reward: float = 0.0
    """The tools' and environment's rewards, summed."""
    turns: int = 0
    tool_calls: int = 0
    bad_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_truncations: int = 0
    env_errors: int = 0

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def context(self) -> list[int]:
        return self.prompt + [t for s in self.segments for t in s.ids]

    @property
    def response_len(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def model_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.model)

    def last_model_turn(self) -> list[int]:
        return next((s.ids for s in reversed(self.segments) if s.model), [])


def rollout_records(conversations: list[Conversation], pad_id: int) -> RolloutBatch:
    """The conversations as one position-aligned batch (module docstring), rows in conversation order."""
    num = len(conversations)
    width = max(len(c.prompt) + c.response_len for c in conversations)
    longest = max(c.response_len for c in conversations)
    tokens = torch.full((num, width), pad_id, dtype=torch.long)
    mask = torch.zeros(num, width)
    log_probs = torch.zeros(num, width)
    response_ids = torch.full((num, max(longest, 1)), pad_id, dtype=torch.long)
    for row, c in enumerate(conversations):
        sequence = c.context
        tokens[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        response_ids[row, : c.response_len] = tokens[row, len(c.prompt) : len(sequence)]
        at = len(c.prompt)
        for segment in c.segments:
            if segment.model:  # column t holds what the logits at t say about token t + 1
                mask[row, at - 1 : at - 1 + len(segment.ids)] = 1.0
                log_probs[row, at - 1 : at - 1 + len(segment.ids)] = torch.as_tensor(segment.log_probs)
            at += len(segment.ids)
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        rollout_log_probs=log_probs,
        response_ids=response_ids,
        response_lengths=torch.tensor([c.response_len for c in conversations], dtype=torch.long),
        prompt_index=torch.tensor([c.prompt_index for c in conversations], dtype=torch.long),
    )


def turn_metrics(conversations: list[Conversation]) -> dict[str, float]:
    """``multi_turn/*``: per sample means of turns and calls, their maxima, rates of each ending, and the
    model's vs the context's tokens after the prompt."""
    num = max(len(conversations), 1)

    def mean(name: str) -> float:
        return sum(getattr(c, name) for c in conversations) / num

    model = sum(c.model_tokens for c in conversations)
    context = sum(c.response_len - c.model_tokens for c in conversations)
    out = {
        "multi_turn/turns_mean": mean("turns"),
        "multi_turn/turns_max": float(max((c.turns for c in conversations), default=0)),
        "multi_turn/tool_calls_mean": mean("tool_calls"),
        "multi_turn/tool_calls_max": float(max((c.tool_calls for c in conversations), default=0)),
        "multi_turn/bad_calls": float(sum(c.bad_calls for c in conversations)),
        "multi_turn/tool_errors": float(sum(c.tool_errors for c in conversations)),
        "multi_turn/tool_timeouts": float(sum(c.tool_timeouts for c in conversations)),
        "multi_turn/tool_truncations": float(sum(c.tool_truncations for c in conversations)),
        "multi_turn/env_errors": float(sum(c.env_errors for c in conversations)),
        "multi_turn/model_tokens_mean": model / num,
        "multi_turn/context_tokens_mean": context / num,
        "multi_turn/tool_reward_mean": mean("reward"),
    }
    for finish in FINISHES:
        out[f"multi_turn/{finish}_rate"] = sum(c.finish == finish for c in conversations) / num
    return out


def conversation_record(c: Conversation, score: float | None = None) -> dict[str, Any]:
    """One conversation for ``generations.jsonl``: its messages, how it ended, its counts and reward."""
    record: dict[str, Any] = {
        "row": c.row,
        "where": c.where,
        "messages": c.messages,
        "finish": c.finish,
        "turns": c.turns,
        "tool_calls": c.tool_calls,
        "tool_reward": c.reward,
        "model_tokens": c.model_tokens,
        "context_tokens": c.response_len - c.model_tokens,
    }
    if score is not None:
        record["score"] = score
    return record
