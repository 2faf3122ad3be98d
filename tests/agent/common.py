"""Shared pieces of the agent tests: the tool demo's real ChatML tokenizer, a scripted token-in/token-out engine
(what a model would write, turn by turn: the loop's logic without a trained model) and prompts."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer, write_tokenizer_config
from mcore_rl.data.tool_task import write_tokenizer
from mcore_rl.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, GenerationOutput, SamplingParams
from mcore_rl.types import PromptBatch


@functools.lru_cache(maxsize=1)
def chatml_tokenizer(folder: str) -> Tokenizer:
    write_tokenizer(folder)
    return load_tokenizer(folder)


QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3's way: only the *last* assistant turn gets an empty ``<think>`` block, so an assistant turn renders
differently once a tool turn follows it and no tool turn can be appended token by token."""


def write_qwen3_like_tokenizer(folder: str) -> None:
    """The demo's ChatML tokenizer with :data:`QWEN3_LIKE_TEMPLATE`."""
    write_tokenizer(folder)
    write_tokenizer_config(
        folder, eos_token="<|im_end|>", pad_token="<pad>", chat_template=QWEN3_LIKE_TEMPLATE
    )


def prompts(tokenizer: Tokenizer, texts: Sequence[str], truths: Sequence[str]) -> PromptBatch:
    ids = [tokenizer.encode(tokenizer.chat_text([{"role": "user", "content": t}])) for t in texts]
    return PromptBatch(
        ids,
        torch.arange(len(ids)),
        ["mcore_rl/tool_calc"] * len(ids),
        list(truths),
        [{"index": i} for i in range(len(ids))],
        [f"test.jsonl row {i}" for i in range(len(ids))],
    )


class ScriptedTurns:
    """A ConversationEngine writing scripted turns: conversation c's k-th call returns ``script[c][k]``
    (encoded, then the stop token), cut at its budget. Records every call's conversations."""

    def __init__(self, tokenizer: Tokenizer, script: dict[int, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[list[int]] = []
        self.contexts: dict[int, list[int]] = {}
        self.ended = 0

    def continue_conversations(
        self,
        conversations: Sequence[int],
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int],
    ) -> GenerationOutput:
        self.calls.append(list(conversations))
        turns = []
        for c, context in zip(conversations, contexts, strict=True):
            previous = self.contexts.get(c)
            assert previous is None or list(context[: len(previous)]) == previous, "a context lost its prefix"
            self.contexts[c] = list(context)
            k = sum(c in call for call in self.calls) - 1
            turns.append([*self.tokenizer.encode(self.script[c][k]), self.tokenizer.eos_token_id])
        width = max(max_new_tokens)
        ids = torch.full((len(turns), width), params.pad_token_id, dtype=torch.long)
        lengths, reasons = [], []
        for i, (turn, budget) in enumerate(zip(turns, max_new_tokens, strict=True)):
            kept = turn[:budget]
            ids[i, : len(kept)] = torch.tensor(kept)
            lengths.append(len(kept))
            reasons.append(FINISH_STOP if len(kept) == len(turn) else FINISH_LENGTH)
        log_probs = torch.where(ids != params.pad_token_id, -0.5, 0.0)
        log_probs = log_probs * (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])
        return GenerationOutput(torch.arange(len(turns)), ids, log_probs, torch.tensor(lengths), reasons)

    def end_conversations(self) -> None:
        self.ended += 1
