"""A model turn read as text: its tool calls (the turns that follow it are written by
:class:`mcore_rl.data.chat_format.ChatFormat`, through the tokenizer's chat template).

**Reading** (``rollout.multi_turn.tool_parser``): :class:`HermesParser` reads Hermes / Qwen tool calls,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each block one call; ``arguments`` may also be a
JSON string of the object (as OpenAI's API writes it). A block that is not JSON, or names no tool, becomes an
error the model reads back (a :class:`BadCall`), never an exception. Calls and bad calls stay in one list in
the order the model wrote them, and are answered in that order: Hermes / Qwen templates match each
``<tool_response>`` to a call by position. Another format plugs in as ``module:Class``: a class with
``parse(text) -> ParsedTurn``.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from mcore_rl.agent.tools import ToolCall, ToolError, load_function


@dataclass(frozen=True)
class BadCall:
    """A call block that could not be read (or one past the turn's limit): never runs, answered with
    ``Error: <message>`` in its place among the turn's calls."""

    message: str


@dataclass(frozen=True)
class ParsedTurn:
    """One model turn, read."""

    content: str
    """The text outside the tool calls."""
    calls: list[ToolCall | BadCall] = field(default_factory=list)
    """Every call block, well-formed or not, in the order written (the order of the answers)."""


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes 2 Pro, Qwen2.5 / Qwen3, verl's ``hermes`` parser)."""

    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    unclosed = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        blocks = self.pattern.findall(text)
        calls = [self._read(block.strip(), i + 1) for i, block in enumerate(blocks)]
        # an unclosed <tool_call> is always the last block: an earlier one would have matched up to the
        # next </tool_call> (and been read as bad JSON)
        if self.unclosed.search(self.pattern.sub("", text)):
            calls.append(BadCall("a <tool_call> was not closed with </tool_call>"))
        return ParsedTurn(self.pattern.sub("", text).strip(), calls)

    @staticmethod
    def _read(block: str, number: int) -> ToolCall | BadCall:
        try:
            value = json.loads(block)
        except json.JSONDecodeError as err:
            return BadCall(f"tool call {number} is not valid JSON ({err.msg} at character {err.pos})")
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return BadCall(f'tool call {number} must be a JSON object with a "name" (and "arguments")')
        arguments: Any = value.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI writes the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):  # else kept as text: the schema check answers it
                arguments = json.loads(arguments)
        return ToolCall(value["name"], arguments)


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
