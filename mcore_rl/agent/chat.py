"""A model turn read as text: its tool calls (the turns that follow it are written by
:class:`mcore_rl.data.chat_format.ChatFormat`, through the tokenizer's chat template).

**Reading** (``rollout.multi_turn.tool_parser``): :class:`HermesParser` reads Hermes / Qwen tool calls,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each block one call; ``arguments`` may also be a
JSON string of the object (as OpenAI's API writes it). A block that is not JSON, or names no tool, becomes an
error the model reads back (a bad call), never an exception. Another format plugs in as ``module:Class``: a
class with ``parse(text) -> ParsedTurn``.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from mcore_rl.agent.tools import ToolCall, ToolError, load_function


@dataclass(frozen=True)
class ParsedTurn:
    """One model turn, read."""

    content: str
    """The text outside the tool calls."""
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in order."""
    errors: list[str] = field(default_factory=list)
    """Malformed calls, each as the message the model reads back."""


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes 2 Pro, Qwen2.5 / Qwen3, verl's ``hermes`` parser)."""

    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    unclosed = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for i, block in enumerate(self.pattern.findall(text)):
            call, error = self._read(block.strip(), i + 1)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        if self.unclosed.search(self.pattern.sub("", text)):
            errors.append("a <tool_call> was not closed with </tool_call>")
        return ParsedTurn(self.pattern.sub("", text).strip(), calls, errors)

    @staticmethod
    def _read(block: str, number: int) -> tuple[ToolCall | None, str]:
        try:
            value = json.loads(block)
        except json.JSONDecodeError as err:
            return None, f"tool call {number} is not valid JSON ({err.msg} at character {err.pos})"
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, f'tool call {number} must be a JSON object with a "name" (and "arguments")'
        arguments: Any = value.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI writes the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):  # else kept as text: the schema check answers it
                arguments = json.loads(arguments)
        return ToolCall(value["name"], arguments), ""


PARSERS: dict[str, type] = {"hermes": HermesParser}


def load_parser(name: str) -> ToolParser:
    """A built-in parser by name (:data:`PARSERS`) or ``module:Class`` / ``file.py:Class``."""
    if name in PARSERS:
        parser: ToolParser = PARSERS[name]()
        return parser
    if ":" not in name:
        raise ToolError(
            f"rollout.multi_turn.tool_parser={name!r}: choose one of {', '.join(PARSERS)} or module:Class"
        )
    parser = load_function(name, "tool parser")()
    if not callable(getattr(parser, "parse", None)):
        raise ToolError(f"rollout.multi_turn.tool_parser={name!r}: its class has no parse(text) method")
    return parser
