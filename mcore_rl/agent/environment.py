"""An environment that answers and rewards a multi-turn conversation (NeMo-RL's ``EnvironmentInterface``):
after every model turn without a tool call, ``step`` reads the conversation so far and says what comes next.

    class Guess:                                   # rollout.multi_turn.environment: my_pkg.envs:Guess
        def step(self, conversation, extra_info):   # conversation: the row's messages (e.g. system, user),
            guess = conversation[-1]["content"]     # then the turns since; the last is the model's
            if guess == extra_info["ground_truth"]:
                return EnvStep(None, reward=1.0, done=True)
            return EnvStep("higher" if ... else "lower", reward=0.0, done=False)

``conversation`` is a list of ``{"role", "content", ...}`` messages: the dataset row's prompt as its own
messages (verl's ``raw_prompt``, NeMo-RL's ``message_log``: system, user, ... with any other fields they carry;
a plain-text prompt is one ``user`` message), then every turn since: ``assistant`` (the model's text as the
tool parser reads it, without the stop token that ended it), ``tool`` (tool answers) and this environment's
observations, the last one the model's. It is the environment's own copy. What the chat template adds when
it renders the prompt (a default system prompt, the tool list) is not in it: the model reads that rendering.

One instance per worker process (built once, called many times), so ``step`` must not keep a conversation's
state between calls: everything it needs is in the conversation and ``extra_info`` (the row's ``extra_info``
with its ``ground_truth`` and ``data_source``). The observation is rendered as the chat template's ``role``
turn (``user`` by default, ``tool`` to read as a tool's answer); rewards add up over the conversation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from mcore_rl.agent.tools import ToolError, load_function


@dataclass(frozen=True)
class EnvStep:
    """What the environment says after a model turn."""

    observation: str | None
    """Text the model reads next; None with ``done`` (nothing more to say)."""
    reward: float = 0.0
    """Added to the conversation's reward."""
    done: bool = False
    """The conversation ends here."""
    role: str = "user"
    """Chat-template role the observation is rendered as (user or tool)."""


class Environment(Protocol):
    def step(self, conversation: list[dict[str, Any]], extra_info: dict[str, Any]) -> Any:
        """An :class:`EnvStep`, or ``(observation, reward, done)``."""
        ...


def as_step(value: Any) -> EnvStep:
    """An environment's return value as an :class:`EnvStep`; TypeError for anything else."""
    if isinstance(value, EnvStep):
        step = value
    elif isinstance(value, tuple) and len(value) == 3:
        step = EnvStep(value[0], value[1], value[2])
    else:
        raise TypeError(f"step returned {value!r:.80}: expected EnvStep or (observation, reward, done)")
    if step.observation is not None and not isinstance(step.observation, str):
        raise TypeError(f"step returned the observation {step.observation!r:.60}, not text or None")
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"step returned the reward {reward!r:.60}, not a number")
    if not math.isfinite(reward):  # an environment error (reward 0), not a NaN loss for the sample's group
        raise TypeError(f"step returned the reward {reward}, not a finite number")
    if step.role not in ("user", "tool"):
        raise TypeError(f"step returned role {step.role!r}: user or tool")
    # plain str / float / bool: a subclass from the user's module would not unpickle in the driver
    observation = None if step.observation is None else str(step.observation)
    return EnvStep(observation, float(reward), bool(step.done), str(step.role))


def load_environment(spec: str) -> Environment:
    """An instance of the class ``module:Class`` / ``file.py:Class`` (built with no arguments)."""
    cls = load_function(spec, "environment")
    try:
        env = cls()
    except Exception as err:
        raise ToolError(f"environment {spec!r}: building it raised {type(err).__name__}: {err}") from None
    if not callable(getattr(env, "step", None)):
        raise ToolError(f"environment {spec!r}: {cls!r} has no step(conversation, extra_info) method")
    return env
