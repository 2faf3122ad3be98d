"""Tool calls and environment steps in sandboxed workers: the memory cap, a worker that dies, answers that are
not answers, environments that fail; the workers are reused across batches."""

from __future__ import annotations

import math

import pytest

from mcore_rl.agent.config import MultiTurnConfig
from mcore_rl.agent.environment import EnvStep
from mcore_rl.agent.executor import EnvAnswer, EnvTask, ToolExecutor, ToolTask
from mcore_rl.agent.tools import ToolCall, load_tools
from mcore_rl.io.fields import FieldError
from mcore_rl.scoring.process_pool import TaskLimits

TOOLS = ["tests.agent.user_tools:hog", "tests.agent.user_tools:not_an_answer", "tests.agent.user_tools:add"]


def test_memory_cap_bad_answers_and_worker_reuse() -> None:
    limits = TaskLimits(num_workers=1, timeout_s=20, memory_limit_bytes=256 << 20, what="tool")
    with ToolExecutor(load_tools(TOOLS), None, limits) as executor:
        first = executor.run(
            [
                ToolTask(ToolCall("hog", {"megabytes": 2048}), "sample 0"),  # past the cap: MemoryError
                ToolTask(ToolCall("hog", {"megabytes": 16}), "sample 1"),  # within it
                ToolTask(ToolCall("not_an_answer", {"x": "1"}), "sample 2"),
                ToolTask(ToolCall("add", {"a": 2, "b": 3}), "sample 3"),
            ]
        )
        worker = executor.pool._workers[0].process.pid
        second = executor.run([ToolTask(ToolCall("add", {"a": 1}), "sample 4")])
        assert executor.pool._workers[0].process.pid == worker  # started once, reused
    assert [a.status for a in first] == ["error", "ok", "error", "ok"]
    assert first[0].text.startswith("Error: hog MemoryError")
    assert first[1].text == str(16 << 20) and first[3].text == "5"
    assert "expected text" in first[2].text
    assert second[0].text == "1"


def test_environment_steps_and_failures() -> None:
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    limits = TaskLimits(num_workers=0, what="tool")
    with ToolExecutor([], "tests.agent.user_tools:CountdownEnv", limits) as executor:
        (answer,) = executor.run([EnvTask(conversation, {"ground_truth": "7"}, "sample 0")])
    assert isinstance(answer, EnvAnswer) and answer.step == EnvStep("go on 7", 0.25, False, "user")
    with ToolExecutor([], "tests.agent.user_tools:BrokenEnv", limits) as executor:
        (broken,) = executor.run([EnvTask(conversation, {}, "sample 1")])
    assert isinstance(broken, EnvAnswer) and broken.status == "error" and broken.step.done
    assert "RuntimeError: the environment broke" in broken.error
    with ToolExecutor([], "tests.agent.user_tools:InfiniteEnv", limits) as executor:
        (infinite,) = executor.run([EnvTask(conversation, {}, "sample 2")])
    assert isinstance(infinite, EnvAnswer) and infinite.status == "error" and infinite.step.reward == 0.0
    assert "the reward inf, not a finite number" in infinite.error


def test_in_the_driver_a_hanging_tool_is_interrupted_at_its_limit() -> None:
    limits = TaskLimits(num_workers=0, timeout_s=0.5, what="tool")
    with ToolExecutor(load_tools(["tests.agent.user_tools:hang"]), None, limits) as executor:
        (answer,) = executor.run([ToolTask(ToolCall("hang", {"seconds": 30}), "sample 0")])
    assert answer.status == "timeout" and "over 0.5 s" in answer.text


def test_an_infinite_tool_time_limit_is_refused_by_the_config() -> None:
    """An infinite limit overflows the driver's alarm (every call an error) and crashes the workers' wait."""
    with pytest.raises(FieldError, match=r"^rollout\.multi_turn\.timeout_s=inf must be a finite number"):
        MultiTurnConfig(timeout_s=math.inf)
