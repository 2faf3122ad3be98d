"""The ``logging`` section: where a run's metrics go and the log-prob agreement alarm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mcore_rl.io.fields import Rule, check_section


@dataclass
class LoggingConfig:
    """What the run reports and where."""

    SECTION: ClassVar[str] = "logging"

    log_dir: str = "${trainer.default_local_dir}/logs"
    """Folder for the metrics JSONL, TensorBoard events and the reward plot."""
    jsonl: bool = True
    """One JSON object per step in ``metrics.jsonl``."""
    tensorboard: bool = False
    """TensorBoard event files."""
    progress_bar: bool = True
    """A live progress bar on the console."""
    plot: bool = True
    """At the end, a PNG of reward and validation accuracy per step."""
    token_mult_prob_error_threshold: float = 1.05
    """Warn (with the worst samples) when the mean exp(|rollout - trainer log-prob|) over response tokens
    exceeds this (NeMo-RL's check; our engines should read 1.000000)."""

    def __post_init__(self) -> None:
        check_section(self, {"token_mult_prob_error_threshold": Rule("> 1", lambda v: v > 1)})
