"""The in-process backend runs calls as a Ray actor does: one at a time, in submission order, each error
with its own call (``trainer/actor_group.InProcessBackend``)."""

from __future__ import annotations

import pytest

from mcore_rl.controller.backend import InProcessBackend
from mcore_rl.types import RankInfo


class _Recorder:
    def __init__(self) -> None:
        self.ran: list[str] = []

    def rank_info(self) -> RankInfo:
        return RankInfo(0, 0, 0, 0, True, 0, 0)

    def update(self, shard: str) -> str:
        self.ran.append(f"update {shard}")
        return f"stats {shard}"

    def sync_weights(self) -> str:
        self.ran.append("sync")
        return "synced"

    def fail(self) -> None:
        self.ran.append("fail")
        raise ValueError("boom")


def test_a_call_runs_when_awaited_after_every_earlier_call() -> None:
    worker = _Recorder()
    backend = InProcessBackend(worker)  # type: ignore[arg-type]
    wait_update = backend.submit("update", ["a"], "dp")
    wait_sync = backend.submit("sync_weights", None, "")
    assert worker.ran == []  # nothing runs at submit: the driver's timers wrap the waits
    assert wait_sync() == ["synced"]
    assert worker.ran == ["update a", "sync"]  # the update first, as a Ray actor runs them
    assert wait_update() == ["stats a"]  # already done: its result, not a second run
    assert worker.ran == ["update a", "sync"]


def test_an_error_stays_with_its_call_and_later_calls_still_run() -> None:
    worker = _Recorder()
    backend = InProcessBackend(worker)  # type: ignore[arg-type]
    wait_fail = backend.submit("fail", None, "")
    wait_sync = backend.submit("sync_weights", None, "")
    assert wait_sync() == ["synced"]
    assert worker.ran == ["fail", "sync"]
    with pytest.raises(ValueError, match="boom"):
        wait_fail()
