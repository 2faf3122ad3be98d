"""Which ``data_source`` has a scorer, decided from the config alone (the start-up check of a run): the
built-in table, ``reward.sources``, ``reward.custom_function``; a missing one is refused naming the source,
where a row of it is, and how to add a scorer."""

from __future__ import annotations

import pytest

from mcore_rl.scoring.config import RewardConfig
from mcore_rl.scoring.registry import ScorerError, check_scorers, has_scorer


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
