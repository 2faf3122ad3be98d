"""The ``rollout.multi_turn`` section: multi-turn, tool-calling rollouts (verl's ``rollout.multi_turn``,
NeMo-RL's ``max_rollout_turns``). Free of torch, as every config section."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from mcore_rl.io.fields import NON_NEGATIVE, OPTIONAL_POSITIVE, POSITIVE, Rule, check_section, choice
from mcore_rl.scoring.config import TIME_LIMIT


class ScoreText(str, Enum):
    """``rollout.multi_turn.score_text``: what text of a conversation the reward rules (``reward.*``) read."""

    LAST_TURN = "last_turn"
    """The model's last turn (its final answer), without the tool calls and answers before it."""
    RESPONSE = "response"
    """Everything after the prompt, the tools' answers included (verl's ``solution_str``)."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: the model calls tools (or an environment answers) between its turns; only the
    model's own tokens are trained on (the rollout's ``response_mask``), the rest is context."""

    SECTION: ClassVar[str] = "rollout.multi_turn"

    enable: bool = False
    """Generate multi-turn conversations instead of one response per sample (training, validation, test)."""
    max_assistant_turns: int = 5
    """Most model turns per sample. A sample still calling a tool on its last turn ends there (counted in
    ``multi_turn/max_turns_rate``)."""
    max_tool_response_length: int = 256
    """Tokens of one tool or environment answer kept; a longer answer is cut to this many (counted in
    ``multi_turn/tool_truncations``) before it is rendered as the template's tool turn."""
    tools: list[str] = field(default_factory=list)
    """The tools the model may call: ``module:function``, ``path/to/file.py:function``, or a YAML file
    listing several (``tools:`` entries with ``function: module:function`` and verl's ``tool_schema``).
    A function's JSON schema is its ``tool_schema`` attribute, else read from its signature and docstring.
    It returns text, ``(text, reward)`` or ``{"text": ..., "reward": ...}``."""
    tools_in_prompt: bool = True
    """Render the tools' schemas into every prompt through the chat template's ``tools`` argument (Qwen's and
    Hermes' templates list them in the system turn); false when the data's prompts describe the tools
    themselves. A template without a ``tools`` section leaves them out either way."""
    environment: str | None = None
    """``module:Class`` or ``file.py:Class`` of an environment that answers each model turn that calls no tool:
    ``step(conversation, extra_info) -> EnvStep(observation, reward, done)`` (``agent/environment.py``, as
    NeMo-RL's); None: a turn without a tool call ends the conversation."""
    tool_parser: str = "hermes"
    """How tool calls are read from a model turn: hermes (Qwen's ``<tool_call>{"name": ..., "arguments":
    ...}</tool_call>``) or ``module:Class`` of a parser with ``parse(text) -> ParsedTurn``."""
    max_tool_calls_per_turn: int = 8
    """Tool calls run from one model turn; more are answered with an error (counted as bad calls)."""
    num_workers: int = 2
    """Worker processes that run tool calls and environment steps (a conversation's calls in parallel with
    the others'); 0 runs them in the driver, without time limit or memory cap."""
    timeout_s: float = 10.0
    """Per tool call (or environment step); past it the worker is killed and replaced and the model reads a
    timeout error (counted in ``multi_turn/tool_timeouts``)."""
    memory_limit_bytes: int | None = 1 << 30
    """Address space a tool worker may add while running calls (``RLIMIT_AS``); past it the call fails with
    a MemoryError the model reads as an error. None: no cap."""
    score_text: str = ScoreText.LAST_TURN.value
    """What the reward rules read: last_turn (the model's final answer) or response (everything after the
    prompt). A sample's reward is their score plus the rewards its tools and environment returned."""
    log_conversation_freq: int = 10
    """Every this many RL steps, one sampled conversation (with its tool calls, answers and reward) is
    appended to ``<log_dir>/generations.jsonl`` (and TensorBoard's text tab); 0: never."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "max_assistant_turns": POSITIVE,
                "max_tool_response_length": POSITIVE,
                "max_tool_calls_per_turn": POSITIVE,
                "num_workers": NON_NEGATIVE,
                "timeout_s": TIME_LIMIT,
                "memory_limit_bytes": OPTIONAL_POSITIVE,
                "score_text": choice(ScoreText),
                "log_conversation_freq": NON_NEGATIVE,
                "tools": Rule(
                    "a list of non-empty specs", lambda v: all(isinstance(t, str) and t for t in v)
                ),
            },
        )
