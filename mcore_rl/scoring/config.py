"""The ``reward`` section: rule rewards by ``data_source``, user scorers, and how scoring failures are handled."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from mcore_rl.io.fields import NON_NEGATIVE, Rule, check_section, choice

MAX_TIMEOUT_S = 1e9
TIME_LIMIT = Rule("a finite number of seconds > 0 (at most 1e9)", lambda v: 0 < v <= MAX_TIMEOUT_S)
"""A per-call limit (``reward.timeout_s``, ``rollout.multi_turn.timeout_s``). Not infinite: the in-process
alarm (``setitimer``) overflows past ~9.2e9 s, which scored every answer 0, and the workers' wait for a
deadline crashed the step; a limit of ~31 years is no limit in practice."""


class OnScorerError(str, Enum):
    """``reward.on_error``: what a scorer that raises, times out or returns a non-number makes of the row."""

    ZERO = "zero"
    """Score it 0, count it in the step's metrics."""
    RAISE = "raise"
    """Stop the run naming the row."""


class GSM8KMethod(str, Enum):
    """``reward.gsm8k_method``: verl's two ways of reading a GSM8K answer."""

    STRICT = "strict"
    FLEXIBLE = "flexible"


@dataclass
class OverlongBuffer:
    """DAPO's soft overlong punishment of training rewards (``scoring/shaping.py``; verl's
    ``reward_model.overlong_buffer``)."""

    SECTION: ClassVar[str] = "reward.overlong_buffer"

    enable: bool = False
    len: int = 4096
    """The last ``len`` tokens of ``rollout.response_length``: a response reaching into them loses reward
    linearly, ``penalty_factor`` at the budget. Must be below ``rollout.response_length``."""
    penalty_factor: float = 1.0
    """The penalty of a response that uses the whole budget."""

    def __post_init__(self) -> None:
        check_section(self, {"len": Rule("> 0", lambda v: v > 0), "penalty_factor": NON_NEGATIVE})


@dataclass
class RewardConfig:
    """Rule rewards (verl's ``default_compute_score`` dispatch by ``data_source``) and user scorers."""

    SECTION: ClassVar[str] = "reward"

    custom_function: str | None = None
    """A user scorer for every row, ``module:function`` or ``path/to/file.py:function``, called as
    ``fn(data_source, solution_str, ground_truth, extra_info)`` and returning a float or a dict with
    ``score`` plus extra metrics. None: the built-in dispatch."""
    sources: dict[str, str] = field(default_factory=dict)
    """Extra ``data_source -> scorer`` entries: a built-in name (gsm8k, math, exact_match) or a
    ``module:function`` / ``file.py:function`` spec. They take precedence over the built-in table."""
    on_error: str = OnScorerError.ZERO.value
    """A scorer that raises, returns NaN or a non-number, or runs past ``timeout_s``: zero (score 0, counted
    in the step's metrics, one warning per kind) or raise (stop, naming the scorer and the row)."""
    num_workers: int = 0
    """Scorer worker processes; 0 scores in the calling process (``timeout_s`` is then an alarm signal, which
    cannot stop a scorer stuck in native code: workers can)."""
    timeout_s: float = 10.0
    """Per-answer limit: past it a worker is killed and replaced (in-process: the scorer is interrupted), and
    the answer is a scorer failure (``on_error``)."""
    gsm8k_method: str = GSM8KMethod.STRICT.value
    """GSM8K answer extraction: strict (the last ``#### number``) or flexible (the last number)."""
    format_score: float = 0.0
    """Score of a well-formed but wrong answer (GSM8K and the format checks)."""
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)
    """DAPO's soft overlong punishment of the training rewards (off by default)."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "on_error": choice(OnScorerError),
                "num_workers": NON_NEGATIVE,
                "timeout_s": TIME_LIMIT,
                "gsm8k_method": choice(GSM8KMethod),
            },
        )
