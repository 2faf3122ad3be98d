"""Tools, an environment and a parser as a user writes them, for the agent tests (loaded by spec string, in
tool worker processes too)."""

from __future__ import annotations

import time
from typing import Any

from mcore_rl.agent.chat import ParsedTurn
from mcore_rl.agent.environment import EnvStep


def add(a: int, b: int = 0) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def scored_lookup(key: str) -> tuple[str, float]:
    """Look a key up; the reward says whether it was known."""
    table = {"x": "42"}
    return (table[key], 1.0) if key in table else ("unknown", -0.5)


def nan_reward(key: str) -> tuple[str, float]:
    """Answer with a reward gone wrong (numpy's 0/0 is NaN, no exception)."""
    return ("42", float("nan"))


def explode(reason: str) -> str:
    """Raise, always."""
    raise ZeroDivisionError(f"exploded on {reason}")


def hang(seconds: float) -> str:
    """Sleep for ``seconds`` (past the time limit)."""
    time.sleep(seconds)
    return "woke up"


def hog(megabytes: int) -> str:
    """Allocate ``megabytes`` of memory."""
    block = bytearray(megabytes * 1024 * 1024)
    return str(len(block))


def not_an_answer(x: str) -> Any:
    """Return something that is not text."""
    return object()


def unannotated(x):  # type: ignore[no-untyped-def]
    return x


def with_schema(q: str) -> str:
    return q.upper()


with_schema.tool_schema = {  # type: ignore[attr-defined]
    "type": "function",
    "function": {
        "name": "shout",
        "description": "Upper-case a query.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


class CountdownEnv:
    """Answers every model turn with ``go on`` and a reward of 0.25, until the model has spoken three times."""

    def step(self, conversation: list[dict[str, Any]], extra_info: dict[str, Any]) -> EnvStep:
        spoken = sum(m["role"] == "assistant" for m in conversation)
        if spoken >= 3:
            return EnvStep(None, reward=1.0, done=True)
        return EnvStep(f"go on {extra_info['ground_truth']}", reward=0.25)


class BrokenEnv:
    def step(self, conversation: list[dict[str, Any]], extra_info: dict[str, Any]) -> Any:
        raise RuntimeError("the environment broke")


class InfiniteEnv:
    def step(self, conversation: list[dict[str, Any]], extra_info: dict[str, Any]) -> EnvStep:
        return EnvStep(None, reward=float("inf"), done=True)


class BracketParser:
    """Calls written as ``[[name]]``, without arguments."""

    def parse(self, text: str) -> ParsedTurn:
        import re

        from mcore_rl.agent.tools import ToolCall

        names = re.findall(r"\[\[(\w+)\]\]", text)
        return ParsedTurn(re.sub(r"\[\[\w+\]\]", "", text), [ToolCall(n, {}) for n in names])


class RecordingEnv:
    """Appends each conversation it is given to the JSON-lines file ``extra_info["record_to"]``, then edits it
    (what it was handed must be its own copy), says ``again`` once and ends the conversation at the next step."""

    def step(self, conversation: list[dict[str, Any]], extra_info: dict[str, Any]) -> EnvStep:
        import json

        with open(extra_info["record_to"], "a") as f:
            f.write(json.dumps({"row": extra_info["row"], "conversation": conversation}) + "\n")
        for message in conversation:
            message["content"] = "edited by the environment"
        if sum(m["role"] == "assistant" for m in conversation) >= 2:
            return EnvStep(None, reward=1.0, done=True)
        return EnvStep("again", reward=0.0)
