"""Where a run's metrics go: one JSON object per record in ``metrics.jsonl``, TensorBoard scalars, a live
progress bar, and at the end a PNG of reward and validation accuracy per step next to the logs."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from mcore_rl.logs.config import LoggingConfig

log = logging.getLogger(__name__)


def emit_record(jsonl: Any, tb: Any, stage: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """``{"stage", "step", **metrics}`` appended to the open JSONL file (flushed, so a crash keeps it) and its
    finite numbers to TensorBoard as ``stage/key``; either sink may be None. Returns the record."""
    record = {"stage": stage, "step": step, **metrics}
    if jsonl is not None:
        jsonl.write(json.dumps(record) + "\n")
        jsonl.flush()
    if tb is not None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                tb.add_scalar(f"{stage}/{key}", value, step)
    return record


class RunLog:
    """Writes records of ``{"stage": ..., "step": ..., metrics...}``; :meth:`close` draws the plot."""

    def __init__(
        self, cfg: LoggingConfig, total_steps: int, resume: bool = False, progress_stage: str = "rl"
    ) -> None:
        self.cfg = cfg
        self.progress_stage = progress_stage
        """The stage whose steps the progress bar counts."""
        self.records: list[dict[str, Any]] = []
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.jsonl_path = os.path.join(cfg.log_dir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a" if resume else "w") if cfg.jsonl else None  # noqa: SIM115
        self._tb: Any = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))
        self._bar: Any = None
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc=progress_stage, unit="step", mininterval=2.0)

    def write(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        self.records.append(emit_record(self._jsonl, self._tb, stage, step, metrics))
        if self._bar is not None and stage == self.progress_stage:
            self._bar.update(step - self._bar.n)
            shown = {k: f"{metrics[k]:.3f}" for k in ("reward", "loss", "val_accuracy") if k in metrics}
            self._bar.set_postfix(shown, refresh=False)

    def close(self) -> str | None:
        """Flush everything; returns the plot's path (None when plotting is off or matplotlib is absent)."""
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        return self._plot() if self.cfg.plot else None

    def _plot(self) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed; no reward plot")
            return None
        rl = [r for r in self.records if r["stage"] == "rl"]
        val = [r for r in self.records if "val_accuracy" in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in rl], [r["reward"] for r in rl], label="reward (train samples)", lw=1)
        ax.plot([r["step"] for r in val], [r["val_accuracy"] for r in val], "o-", label="validation accuracy")
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(self.cfg.log_dir, "reward.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path
