"""The hang watchdog's rank side, in this process: a call past its limit leaves the rank's Python stack in its
file (from faulthandler's own thread), a call within it leaves nothing; the driver's line names the phase, the
late ranks and where each was stuck. (Through Ray: tests/controller/test_worker_group.py.)"""

from __future__ import annotations

import time

from mcore_rl.controller import watchdog


class _Rank:
    def __init__(self) -> None:
        self.calls = 0

    def fast(self) -> int:
        self.calls += 1
        return self.inner()  # a call on its own worker is inside the same phase

    def inner(self) -> int:
        return 7

    def stuck(self, seconds: float) -> None:
        time.sleep(seconds)

    @staticmethod
    def helper() -> None:
        """Not a method of the rank: left as it is."""

    def _private(self) -> None: ...


def test_a_call_past_its_limit_leaves_the_ranks_stack_and_names_where(tmp_path) -> None:
    methods = watchdog.watched_methods(_Rank)
    assert sorted(methods) == ["fast", "inner", "stuck"]
    rank_cls = type("_Rank", (_Rank,), methods)
    rank = rank_cls()
    assert rank.fast() == 7  # no watchdog installed yet: as it was
    path = watchdog.stack_file(str(tmp_path / "stacks"), "HybridWorker", 1)
    watchdog.configure(rank, path, timeout_s=0.3)
    assert rank.fast() == 7
    time.sleep(0.6)  # past the limit after the call returned: the timer was cancelled
    with open(path) as f:
        assert "Timeout" not in f.read()
    rank.stuck(1.0)
    with open(path) as f:
        dump = f.read()
    assert "Timeout (0:00:00.300000)!" in dump and "in stuck" in dump
    assert watchdog.where_stuck(path) == f"stuck ({__name__.rsplit('.', 1)[-1]}.py:{_line_of_sleep()})"
    line = watchdog.hang_message("update", 0.3, [1], [0], {1: path})
    assert line == (
        "phase 'update' made no progress for 0.3 s (trainer.phase_timeout_s): ranks [1] did not finish (ranks "
        f"[0] did): rank 1 in {watchdog.where_stuck(path)}; Python stacks in {tmp_path / 'stacks'}"
    )


def _line_of_sleep() -> int:
    import inspect

    source, first = inspect.getsourcelines(_Rank.stuck)
    return first + next(i for i, text in enumerate(source) if "time.sleep" in text)
