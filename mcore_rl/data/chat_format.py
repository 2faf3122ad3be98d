"""The tokens between a model's turns, as the tokenizer's chat template renders them (no template of our own):
what a multi-turn rollout appends after a model turn (tool answers, an environment's message, the next
assistant prompt) and what a multi-turn SFT example is made of, the same tokens in both.

They are taken as a difference of two renderings: a conversation ending with an assistant turn, and the same
conversation with the tool answers and the next assistant prompt. The difference starts where the template
closes the assistant turn; the model's turn already ended with its stop token (ChatML's ``<|im_end|>``), so
the tokens appended are the rest of the close (ChatML: ``\\n``), the tool turn (Qwen: ``<|im_start|>user\\n
<tool_response>...</tool_response><|im_end|>\\n``) and the generation prompt (``<|im_start|>assistant\\n``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from mcore_rl.data.tokenizer import Message, Tokenizer, TokenizerError

_ASSISTANT = "MCORE_RL_ASSISTANT_TURN"
"""A content no template rewrites, marking where the assistant's text sits in a rendering."""


class ChatFormat:
    """The tokens between a model turn that ended with its stop token and the next model turn."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        where = getattr(tokenizer, "path", "the tokenizer")
        opening = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT}]
        base = tokenizer.chat_text(opening, add_generation_prompt=False)
        if _ASSISTANT not in base:
            raise TokenizerError(f"{where}: its chat template drops an assistant turn's content")
        self._opening = opening
        self._base = base
        self._close = base.split(_ASSISTANT)[-1]
        """What the template writes after an assistant turn's text (ChatML: ``<|im_end|>\n``)."""
        self._where = where

    @property
    def close(self) -> str:
        """What the template writes after an assistant turn's text (ChatML: ``<|im_end|>\n``)."""
        return self._close

    def _closing_text(self, token: int | None) -> str | None:
        """The text of ``token``, the last of a model turn, where it is the one that ended the turn: the
        eos, or a special token the template's close begins with (ChatML's ``<|im_end|>`` as a stop id of a
        model whose eos is another token); None otherwise."""
        if token is None:
            return None
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        special = not self.tokenizer.decode([token], skip_special_tokens=True)
        if token == self.tokenizer.eos_token_id or (special and text and self._close.startswith(text)):
            return text
        return None

    def next_turn_ids(self, messages: list[dict[str, str]], ended_by: int | None = None) -> list[int]:
        """Tokens that follow a model turn ended by its stop token ``ended_by`` (default the eos) when
        ``messages`` (tool answers as ``{"role": "tool", "content": ...}``, or an environment's ``user``
        message) come next, up to and including the next assistant turn's generation prompt. The close is
        written after that stop token, without its first token again where the stop token is it; all of the
        close where it is not (the stop token then stays as written)."""
        full = self.tokenizer.chat_text([*self._opening, *messages], add_generation_prompt=True)
        if not full.startswith(self._base):
            role = messages[0]["role"] if messages else "tool"
            raise TokenizerError(
                f"{self._where}: its chat template renders an assistant turn differently when a {role} turn "
                f"follows it; a {role} turn cannot be appended to a conversation token by token"
            )
        stop = self._closing_text(self.tokenizer.eos_token_id if ended_by is None else ended_by)
        close = self._close[len(stop) :] if stop and self._close.startswith(stop) else self._close
        return self.tokenizer.encode(close + full[len(self._base) :])

    def check_appendable(self, roles: Sequence[str] = ("tool",)) -> None:
        """Raise, now, the :class:`TokenizerError` the first turn of each of ``roles`` appended after a model
        turn would raise mid-rollout (a template that renders the last assistant turn differently, as Qwen3's
        adds an empty ``<think>`` block to it only, or one that refuses the role)."""
        for role in roles:
            try:
                self.next_turn_ids([{"role": role, "content": "x"}])
            except TokenizerError:
                raise
            except Exception as err:  # the template itself refuses (jinja's raise_exception, a bad role)
                raise TokenizerError(
                    f"{self._where}: its chat template cannot render a {role} turn after an assistant turn "
                    f"({type(err).__name__}: {err})"
                ) from None

    def turn_text(self, ids: list[int]) -> str:
        """A model turn's text as the parser reads it: special tokens kept (``<tool_call>`` may be one), the
        stop token that ended it left out."""
        if ids and self._closing_text(ids[-1]) is not None:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def answer_text(self, ids: list[int]) -> str:
        """A model turn's text without special tokens (what a reward rule reads)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_CHAT_FORMATS: weakref.WeakKeyDictionary[Any, ChatFormat] = weakref.WeakKeyDictionary()


def chat_format_of(tokenizer: Tokenizer) -> ChatFormat:
    """One :class:`ChatFormat` per tokenizer (building one renders the template)."""
    if tokenizer not in _CHAT_FORMATS:
        _CHAT_FORMATS[tokenizer] = ChatFormat(tokenizer)
    return _CHAT_FORMATS[tokenizer]


def conversation_ids(
    tokenizer: Tokenizer, chat: ChatFormat, prompt_ids: Sequence[int], turns: Sequence[Message]
) -> tuple[list[int], list[int]]:
    """The tokens after ``prompt_ids`` of a conversation whose ``turns`` alternate between the assistant (text as
    the model writes it, tool calls included, then its stop token) and what answers it (``tool`` or ``user``
    messages, grouped as one turn) -> (tokens, mask: 1 on the assistant's tokens and stop tokens, 0 elsewhere):
    exactly what a multi-turn rollout of the same turns holds."""
    ids: list[int] = []
    mask: list[int] = []
    pending: list[Message] = []
    for turn in turns:
        if turn["role"] != "assistant":
            pending.append(turn)
            continue
        if pending:
            follow = chat.next_turn_ids(pending)
            ids, mask, pending = ids + follow, mask + [0] * len(follow), []
        own = [*tokenizer.encode(turn["content"]), tokenizer.eos_token_id]
        ids, mask = ids + own, mask + [1] * len(own)
    if pending or not ids:
        raise TokenizerError("a multi-turn example must end with an assistant turn")
    return ids, mask


class WithTools:
    """A tokenizer whose chat template always renders ``tools`` (OpenAI function schemas): every prompt of a
    multi-turn run lists the tools the model may call, as Qwen's and Hermes' templates do in their system
    turn, and the tool turns are rendered in the same context (``rollout.multi_turn.tools_in_prompt``)."""

    def __init__(self, tokenizer: Tokenizer, tools: Sequence[dict[str, Any]]) -> None:
        self.inner = tokenizer
        self.tools = list(tools)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.vocab_size = tokenizer.vocab_size
        self.has_chat_template = tokenizer.has_chat_template
        self.path = getattr(tokenizer, "path", "the tokenizer")
        self.text_prefix = tokenizer.text_prefix

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens)

    def chat_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        return self.inner.chat_text(messages, add_generation_prompt, self.tools if tools is None else tools)
