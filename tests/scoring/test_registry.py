"""Which ``data_source`` has a scorer, decided from the config alone (the start-up check of a run): the
built-in table, ``reward.sources``, ``reward.custom_function``; a missing one is refused naming the source,
where a row of it is, and how to add a scorer."""

from __future__ import annotations

import pytest

from mcore_rl.scoring.config import RewardConfig
from mcore_rl.scoring.registry import ScoreDispatch, ScorerError, check_scorers, has_scorer


def test_built_ins_sources_and_a_custom_function_count_as_scorers() -> None:
    plain = RewardConfig()
    assert all(
        has_scorer(s, plain) for s in ("openai/gsm8k", "lighteval/MATH", "aime_2024", "mcore_rl/arithmetic")
    )
    assert not has_scorer("my/task", plain)
    assert has_scorer("my/task", RewardConfig(sources={"my/task": "exact_match"}))
    assert has_scorer("my/task", RewardConfig(custom_function="tests/scoring/user_scorers.py:with_metrics"))
    check_scorers(RewardConfig(sources={"my/task": "exact_match"}), {"my/task": "t.jsonl row 0"})


def test_a_source_without_a_scorer_is_refused_naming_every_one() -> None:
    sources = {
        "openai/gsm8k": "train.parquet row 0",
        "my/task": "val.parquet row 3",
        "other": "test.jsonl row 0",
    }
    with pytest.raises(
        ScorerError, match=r"no scorer for data_source 'my/task' \(val.parquet row 3\) \(also 'other'\)"
    ):
        check_scorers(RewardConfig(), sources)


def test_ground_truths_the_built_in_rules_cannot_compare_are_named() -> None:
    """Found by a probe: a dict ground truth was accepted and every answer scored 0. Rows a user scorer reads
    keep whatever they hold."""
    from mcore_rl.scoring.registry import ground_truth_problem

    cfg = RewardConfig()
    assert ground_truth_problem(cfg, "openai/gsm8k", "72") is None
    assert ground_truth_problem(cfg, "lighteval/MATH", 0.5) is None
    problem = ground_truth_problem(cfg, "openai/gsm8k", {"answer": "72"})
    assert problem is not None and problem.startswith(
        "is a dict ({'answer': '72'}); the built-in scorer 'gsm8k'"
    )
    assert "is a bool" in str(ground_truth_problem(cfg, "openai/gsm8k", True))
    assert "empty" in str(ground_truth_problem(cfg, "openai/gsm8k", " "))
    assert ground_truth_problem(RewardConfig(custom_function="m:f"), "openai/gsm8k", {"a": 1}) is None
    assert ground_truth_problem(RewardConfig(sources={"mine": "exact_match"}), "mine", [1]) is not None
    assert ground_truth_problem(cfg, "no/scorer", {"a": 1}) is None  # check_scorers names that source


def test_a_user_scorer_that_cannot_take_verls_arguments_is_refused_before_scoring(tmp_path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(
        "def two(solution, truth):\n    return 1.0\n\ndef flexible(*args, **kwargs):\n    return 0.0\n"
    )
    with pytest.raises(ScorerError, match=r"cannot be called as fn\(data_source, solution_str, ground_truth"):
        ScoreDispatch(RewardConfig(custom_function=f"{path}:two"))
    ScoreDispatch(RewardConfig(custom_function=f"{path}:flexible"))


def test_an_integer_valued_float_ground_truth_matches_the_integer_answer() -> None:
    """A numeric parquet column with any NaN is float64: its 72.0 must match an answer of 72 (it scored the
    format score or 0 for every answer), while 0.5 stays 0.5."""
    from mcore_rl.scoring.registry import builtin_scorer, truth_text

    cfg = RewardConfig()
    assert (truth_text(72.0), truth_text(0.5), truth_text(72), truth_text("72.0")) == (
        "72",
        "0.5",
        "72",
        "72.0",
    )
    gsm8k, exact = builtin_scorer("gsm8k", cfg), builtin_scorer("exact_match", cfg)
    assert gsm8k("openai/gsm8k", "so #### 72", 72.0, {}) == 1.0
    assert gsm8k("openai/gsm8k", "so #### 73", 72.0, {}) == 0.0
    assert exact("mine", "72", 72.0, {}) == 1.0 and exact("mine", "0.5", 0.5, {}) == 1.0
    assert builtin_scorer("math", cfg)("lighteval/MATH", "\\boxed{72}", 72.0, {}) == 1.0
