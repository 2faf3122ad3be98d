"""Scoring a batch: error and NaN policy, dict metrics, and worker processes with a per-answer timeout
(a hung answer is killed and replaced within the limit; a dead worker is replaced)."""

from __future__ import annotations

import math
import time

import pytest

from mcore_rl.config import RewardConfig
from mcore_rl.io.fields import FieldError
from mcore_rl.scoring import RewardError, RewardScorer, ScoreRequest

USER = "tests.scoring.user_scorers:with_metrics"


def requests(*answers: str) -> list[ScoreRequest]:
    return [ScoreRequest("user", a, "ok", {}, where=f"t.parquet row {i}") for i, a in enumerate(answers)]


def test_failures_score_zero_and_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    with RewardScorer(RewardConfig(custom_function=USER)) as scorer:
        out = scorer.score(requests("ok", "raise", "nan", "bad", "no-score"))
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert (out.num_errors, out.num_nonfinite, out.num_timeouts) == (2, 1, 0)
    assert out.extra["length"][0] == 2 and out.extra["length"][3] == 3 and math.isnan(out.extra["length"][1])
    assert "note" not in out.extra  # only numbers are metrics
    assert "RuntimeError: scorer bug" in caplog.text and "t.parquet row 1" in caplog.text


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ("raise", "RuntimeError: scorer bug"),
        ("nan", "returned nan"),
        ("text", "returned 'seven', not a number"),
        ("hang", "over 0.5 s"),
    ],
)
def test_raise_policy_names_the_scorer_and_the_row(answer: str, cause: str) -> None:
    """``reward.on_error=raise``: one line naming the scorer and the row, an input error (exit 1, no traceback);
    a hang in this process too (an alarm interrupts it at ``reward.timeout_s``)."""
    from mcore_rl.io.errors import InputError

    scorer = RewardScorer(RewardConfig(custom_function=USER, on_error="raise", timeout_s=0.5))
    start = time.perf_counter()
    with pytest.raises(
        RewardError, match=rf"^reward.custom_function={USER} failed on row 1 \(t\.parquet row 1\): {cause}"
    ) as info:
        scorer.score(requests("ok", answer))
    assert isinstance(info.value, InputError) and time.perf_counter() - start < 5


def test_a_hung_answer_in_this_process_is_interrupted_and_counted() -> None:
    with RewardScorer(RewardConfig(custom_function=USER, timeout_s=0.5)) as scorer:
        start = time.perf_counter()
        out = scorer.score(requests("ok", "hang", "ok"))
    assert time.perf_counter() - start < 5
    assert out.scores.tolist() == [1.0, 0.0, 1.0] and out.num_timeouts == 1


def test_workers_time_out_a_hung_answer_and_keep_going() -> None:
    cfg = RewardConfig(num_workers=2, timeout_s=2.0, sources={"user": USER})
    with RewardScorer(cfg) as scorer:
        scorer.score(requests("ok"))  # workers started and warm
        start = time.perf_counter()
        batch = [
            *requests("ok", "hang", "die", "raise"),
            ScoreRequest("lighteval/MATH", "\\boxed{0.5}", "\\frac12"),
        ]
        out = scorer.score(batch)
        elapsed = time.perf_counter() - start
        assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]  # math-verify runs inside a worker too
        assert (out.num_timeouts, out.num_errors) == (1, 2)  # the dead worker and the raising scorer
        assert elapsed < 2.0 + 5.0, "the hung answer must cost its timeout, not a stalled step"
        pids = [w.process.pid for w in scorer._workers]
        assert all(w.process.is_alive() for w in scorer._workers) and len(pids) == 2
        assert scorer.score(requests("ok", "ok", "ok")).scores.tolist() == [1.0, 1.0, 1.0]
    assert scorer._workers == []


def test_a_worker_killed_while_idle_is_replaced_at_the_next_batch() -> None:
    """Between two steps the OOM killer (here SIGKILL) takes an idle worker: the next batch is scored in full
    by its replacement, no error counted."""
    import os
    import signal

    cfg = RewardConfig(num_workers=2, timeout_s=5.0, sources={"user": USER})
    with RewardScorer(cfg) as scorer:
        assert scorer.score(requests("ok", "ok")).scores.tolist() == [1.0, 1.0]
        # one that answered (a worker that dies before it ever said ready is a failed start, refused)
        victim = next(w for w in scorer._workers if w.ready).process
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=5)
        out = scorer.score(requests("ok", "ok", "ok", "ok"))
        assert out.scores.tolist() == [1.0] * 4 and out.num_errors == 0
        assert victim not in [w.process for w in scorer._workers] and len(scorer._workers) == 2


@pytest.mark.parametrize("limit", [math.inf, math.nan, 1e12])
def test_a_time_limit_that_is_no_limit_is_refused_by_the_config(limit: float) -> None:
    """In this process an infinite (or huge) ``timeout_s`` overflowed the alarm and scored every answer 0; in
    workers it crashed the step: refused where the config is read, naming the field."""
    with pytest.raises(FieldError, match=r"^reward\.timeout_s=.* must be a finite number of seconds > 0"):
        RewardConfig(timeout_s=limit)


def test_worker_scores_of_a_scorers_own_class_equal_the_in_process_scores(tmp_path) -> None:
    """A ``file.py`` scorer returning its own class (with ``__float__``): its module exists in the worker
    only, so the score is made a float there; the driver once failed to unpickle it and the step crashed."""
    scorer_file = tmp_path / "own_class.py"
    scorer_file.write_text(
        "class Score(float):\n    pass\n\n\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': Score(solution_str == ground_truth), 'length': Score(len(solution_str))}\n"
    )
    spec = f"{scorer_file}:score"
    for workers in (0, 1):
        with RewardScorer(RewardConfig(custom_function=spec, num_workers=workers)) as scorer:
            out = scorer.score(requests("ok", "no"))
        assert out.scores.tolist() == [1.0, 0.0] and out.num_errors == 0, workers
        assert out.extra["length"].tolist() == [2.0, 2.0]


def test_a_result_the_driver_cannot_read_is_that_tasks_error() -> None:
    from mcore_rl.scoring.process_pool import TaskLimits, TaskPool
    from tests.scoring.user_scorers import pool_handler

    with TaskPool(pool_handler, TaskLimits(num_workers=1, timeout_s=10, what="scorer")) as pool:
        out = pool.run(["a", "unreadable", "b"])
        assert out[0] == ("ok", "a") and out[2] == ("ok", "b")
        assert out[1][0] == "error" and "RuntimeError: cannot be rebuilt here" in out[1][1]
        assert pool.run(["c"]) == [("ok", "c")] and len(pool._workers) == 1  # replaced, not stopped


def test_a_run_that_stops_early_leaves_no_answer_for_the_next_run(monkeypatch) -> None:
    """A run interrupted while a worker holds a task: that worker's late answer must not land in the next
    run's slot of the same index (another request's)."""
    from mcore_rl.scoring.process_pool import TaskLimits, TaskPool
    from tests.scoring.user_scorers import pool_handler

    with TaskPool(pool_handler, TaskLimits(num_workers=2, timeout_s=10, what="scorer")) as pool:
        pool.run(["warm", "up"])
        receive = pool._wait_and_receive

        def interrupted(results: list) -> None:
            if any(w.task for w in pool._workers):
                raise RuntimeError("interrupted")
            receive(results)

        monkeypatch.setattr(pool, "_wait_and_receive", interrupted)
        with pytest.raises(RuntimeError, match="interrupted"):
            pool.run([("sleep", 0.5)])
        monkeypatch.undo()
        assert pool.run(["x", "y"]) == [("ok", "x"), ("ok", "y")]
