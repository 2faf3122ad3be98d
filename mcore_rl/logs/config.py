"""The ``logging`` section: where a run's metrics go and the log-prob agreement alarm."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

from mcore_rl.io.fields import NON_NEGATIVE, Rule, check_section, one_of


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

    log_val_generations: int = 0
    """At each validation and held-out test, this many of its samples (prompt, response, ground truth, score)
    appended to ``<log_dir>/generations.jsonl`` with the stage and step (and to TensorBoard as a text table
    when ``tensorboard`` is on); verl's ``trainer.log_val_generations``. The first rows of the set, so every
    validation shows the same prompts. 0: none."""
    wandb: bool = False
    """Every record to a Weights & Biases run too (``pip install wandb``), in ``<log_dir>/wandb``."""
    wandb_mode: str = "offline"
    """W&B's mode: offline (no network; ``wandb sync <log_dir>/wandb/offline-run-*`` uploads later), online,
    or disabled."""
    mlflow: bool = False
    """Every record to an MLflow run too (``pip install mlflow-skinny``)."""
    mlflow_tracking_uri: str = "${logging.log_dir}/mlruns"
    """Where MLflow writes: a local file store under the log folder by default (``mlflow ui
    --backend-store-uri <that folder>`` shows it), or a ``sqlite://`` / ``http(s)://`` tracking URI."""
    tracker_project: str = "${trainer.project_name}"
    """The W&B project and the MLflow experiment of the run."""
    tracker_run_name: str = "${trainer.experiment_name}"
    """The W&B and MLflow run name."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "token_mult_prob_error_threshold": Rule("> 1", lambda v: v > 1),
                "log_val_generations": NON_NEGATIVE,
                "wandb": Rule(
                    "false, or wandb installed: pip install wandb", lambda v: not v or _has("wandb")
                ),
                "wandb_mode": one_of("offline", "online", "disabled"),
                "mlflow": Rule(
                    "false, or mlflow installed: pip install mlflow-skinny", lambda v: not v or _has("mlflow")
                ),
            },
        )


def _has(module: str) -> bool:
    """``module`` can be imported; found without importing it, so that the config check stays instant."""
    if module in sys.modules:
        return sys.modules[module] is not None
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec
        return False
