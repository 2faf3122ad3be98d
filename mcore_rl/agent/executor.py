"""Tool calls and environment steps in sandboxed worker processes: a time limit per call, a memory cap, a
worker that hangs or dies replaced (``scoring/process_pool.py``, the scorers' machinery). One turn's calls of
every conversation run in one batch, spread over ``rollout.multi_turn.num_workers`` workers.

What never reaches a worker: a call of an unknown tool, or whose arguments break the tool's schema; it is
answered with the reason (status ``bad_call``). A function that raises or returns something that is not an
answer, and a call past its time limit, are answered with the error (status ``error`` / ``timeout``) and
logged once per kind per batch, naming the tool and the sample (its prompt's file and row); the rollout goes
on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.agent.environment import EnvStep, as_step, load_environment
from mcore_rl.agent.tools import ToolAnswer, ToolCall, ToolSpec, as_answer, check_arguments, load_function
from mcore_rl.scoring.process_pool import TaskLimits, TaskPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolTask:
    """One tool call of one sample."""

    call: ToolCall
    where: str
    """The sample, for messages (``sample 5 (train.parquet row 17)``)."""


@dataclass(frozen=True)
class EnvTask:
    """One environment step of one sample."""

    conversation: list[dict[str, Any]]
    extra_info: dict[str, Any]
    where: str


@dataclass(frozen=True)
class EnvAnswer:
    """An environment step's result, or its failure (then the conversation ends with reward 0)."""

    step: EnvStep
    status: str = "ok"
    """ok, error or timeout."""
    error: str = ""


def _handler(functions: dict[str, str], environment: str | None) -> Callable[[Any], Any]:
    """Built once in each worker: the tools' functions and the environment, loaded there."""
    loaded = {name: load_function(spec) for name, spec in functions.items()}
    env = load_environment(environment) if environment else None

    def handle(task: tuple[str, Any, Any]) -> Any:
        kind, first, second = task
        if kind == "tool":
            return as_answer(loaded[first](**second), first)
        assert env is not None
        return as_step(env.step(first, second))

    return handle


class ToolExecutor:
    """Runs the tools and environment of ``rollout.multi_turn`` (module docstring); a context manager."""

    def __init__(self, tools: Sequence[ToolSpec], environment: str | None, limits: TaskLimits) -> None:
        self.tools = {t.name: t for t in tools}
        self.environment = environment
        if environment:
            load_environment(environment)  # a bad spec fails now, naming it, not in a worker
        factory = functools.partial(_handler, {t.name: t.function for t in tools}, environment)
        self.pool = TaskPool(factory, limits)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    def run(self, tasks: Sequence[ToolTask | EnvTask]) -> list[ToolAnswer | EnvAnswer]:
        """Every task's answer, in order; the valid ones run together in the workers."""
        answers: list[ToolAnswer | EnvAnswer | None] = [None] * len(tasks)
        runnable: list[int] = []
        for i, task in enumerate(tasks):
            if isinstance(task, ToolTask):
                problem = self._check_call(task.call)
                if problem is not None:
                    answers[i] = ToolAnswer(f"Error: {problem}", status="bad_call")
                    continue
            runnable.append(i)
        outcomes = self.pool.run([self._payload(tasks[i]) for i in runnable])
        failures: dict[str, list[str]] = {}
        for i, (status, value) in zip(runnable, outcomes, strict=True):
            task = tasks[i]
            if isinstance(task, ToolTask):
                answers[i] = self._tool_answer(task, status, value, failures)
            else:
                answers[i] = self._env_answer(task, status, value, failures)
        for kind, labels in failures.items():
            log.warning("%d %s; first: %s", len(labels), kind, labels[0])
        return [a for a in answers if a is not None]

    def _check_call(self, call: ToolCall) -> str | None:
        spec = self.tools.get(call.name)
        if spec is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return f"unknown tool {call.name!r}; the tools are: {known}"
        return check_arguments(spec, call.arguments)

    @staticmethod
    def _payload(task: ToolTask | EnvTask) -> tuple[str, Any, Any]:
        if isinstance(task, ToolTask):
            return ("tool", task.call.name, task.call.arguments)
        return ("env", task.conversation, task.extra_info)

    @staticmethod
    def _tool_answer(task: ToolTask, status: str, value: Any, failures: dict[str, list[str]]) -> ToolAnswer:
        if status == "ok":
            text, reward = value
            return ToolAnswer(text, reward)
        kind = "tool timeout(s)" if status == "timeout" else "tool error(s)"
        failures.setdefault(kind, []).append(f"tool {task.call.name} on {task.where}: {value}")
        return ToolAnswer(
            f"Error: {task.call.name} {'timed out: ' if status == 'timeout' else ''}{value}", status=status
        )

    @staticmethod
    def _env_answer(task: EnvTask, status: str, value: Any, failures: dict[str, list[str]]) -> EnvAnswer:
        if status == "ok":
            return EnvAnswer(value)
        kind = "environment timeout(s)" if status == "timeout" else "environment error(s)"
        failures.setdefault(kind, []).append(f"environment step on {task.where}: {value}")
        return EnvAnswer(EnvStep(None, 0.0, True), status=status, error=str(value))
