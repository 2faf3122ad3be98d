"""Rewards from rules and user functions, dispatched by ``data_source`` as verl does.

    RewardScorer(cfg.reward).score([ScoreRequest(data_source, solution_str, ground_truth, extra_info)])
        -> RewardOutput(scores [N], extra metrics, error / NaN / timeout counts)

:mod:`~mcore_rl.scoring.rules` holds the rule functions (GSM8K, MATH boxed answers with math-verify, exact
match, format), :mod:`~mcore_rl.scoring.registry` the dispatch and user scorers (``module:function`` or
``file.py:function``), :mod:`~mcore_rl.scoring.pool` the worker processes with a per-answer timeout.
"""

from mcore_rl.scoring.pool import RewardError, RewardOutput, RewardScorer, ScoreRequest
from mcore_rl.scoring.registry import (
    BUILTIN_NAMES,
    DEMO_DATA_SOURCE,
    ScoreDispatch,
    ScorerError,
    default_scorer_name,
    load_user_scorer,
)

__all__ = [
    "BUILTIN_NAMES",
    "DEMO_DATA_SOURCE",
    "RewardError",
    "RewardOutput",
    "RewardScorer",
    "ScoreDispatch",
    "ScoreRequest",
    "ScorerError",
    "default_scorer_name",
    "load_user_scorer",
]
