"""The hang watchdog's rank side, in this process: a call past its limit leaves the rank's Python stack in its
file (from faulthandler's own thread), a call within it leaves nothing; the driver's line names the phase, the
late ranks and where each was stuck. (Through Ray: tests/controller/test_worker_group.py.)"""

from __future__ import annotations

import os
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
        assert f.read() == ""
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


def test_a_healthy_rank_leaves_no_stack_file_and_no_claim_of_a_hang(tmp_path) -> None:
    """Found by a review: every healthy run left ``stacks/<worker>.txt`` headed "stacks of calls still running
    after 1800 s", written when the watchdog was installed."""
    rank = type("_Rank", (_Rank,), watchdog.watched_methods(_Rank))()
    folder = tmp_path / "logs" / "stacks"
    path = watchdog.stack_file(str(folder), "HybridWorker", 0)
    watchdog.configure(rank, path, timeout_s=0.3)
    assert not folder.exists()  # installed: nothing written
    assert rank.fast() == 7 and rank.fast() == 7
    time.sleep(0.5)
    assert rank.calls == 2 and (folder / "HybridWorker_rank0.txt").read_text() == ""  # no claim of a hang
    watchdog.remove_unwritten([path])  # the group's shutdown: no file, no folder left
    assert not folder.exists()


def test_a_late_phases_stacks_stay_when_the_group_shuts_down(tmp_path) -> None:
    rank = type("_Rank", (_Rank,), watchdog.watched_methods(_Rank))()
    folder = tmp_path / "stacks"
    late, idle = watchdog.stack_file(str(folder), "HybridWorker", 0), str(folder / "HybridWorker_rank1.txt")
    watchdog.configure(rank, late, timeout_s=0.3)
    rank.stuck(0.6)
    assert rank.fast() == 7  # the next healthy phase leaves the dump as it is
    open(idle, "w").close()
    watchdog.remove_unwritten([late, idle])
    dump = (folder / "HybridWorker_rank0.txt").read_text()
    assert dump.startswith("Timeout (0:00:00.300000)!") and "in stuck" in dump
    assert not os.path.exists(idle)
