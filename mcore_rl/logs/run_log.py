"""Where a run's metrics go (RL, SFT and DPO alike): one JSON object per record in ``metrics.jsonl``,
TensorBoard scalars, a live progress bar, and at the end a PNG drawn from the records (``plots.py``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from mcore_rl.logs.config import LoggingConfig

Plot = Callable[[list[dict[str, Any]], str], str | None]
"""(records, log folder) -> the PNG written, or None (nothing to draw, or matplotlib missing)."""


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
    """Writes records of ``{"stage": ..., "step": ..., metrics...}``; :meth:`close` draws the plot.

    ``progress_stage``: the stage whose steps the progress bar counts, showing the ``bar_metrics`` (label ->
    record key) it has. ``start_step`` > 0 continues a resumed run: the JSONL is appended to and the bar starts
    there. ``enabled=False`` (ranks other than 0 of a run they share) writes nothing."""

    def __init__(
        self,
        cfg: LoggingConfig,
        total_steps: int,
        *,
        progress_stage: str = "rl",
        bar_metrics: Mapping[str, str] | None = None,
        plot: Plot | None = None,
        start_step: int = 0,
        enabled: bool = True,
    ) -> None:
        self.cfg = cfg
        self.progress_stage = progress_stage
        self.bar_metrics = dict(bar_metrics or {k: k for k in ("reward", "loss", "val_accuracy")})
        self.draw = plot
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._jsonl: Any = None
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.jsonl_path = os.path.join(cfg.log_dir, "metrics.jsonl")
        if cfg.jsonl:
            self._jsonl = open(self.jsonl_path, "a" if start_step else "w")  # noqa: SIM115
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc=progress_stage, unit="step", mininterval=2.0
            )

    def write(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(emit_record(self._jsonl, self._tb, stage, step, metrics))
        if self._bar is not None and stage == self.progress_stage:
            self._bar.update(step - self._bar.n)
            shown = {k: f"{metrics[v]:.3f}" for k, v in self.bar_metrics.items() if v in metrics}
            self._bar.set_postfix(shown, refresh=False)

    def close(self) -> str | None:
        """Flush everything; returns the plot's path (None when off, disabled, or nothing was drawn)."""
        for handle in (self._bar, self._jsonl, self._tb):
            if handle is not None:
                handle.close()
        if not (self.enabled and self.cfg.plot and self.draw is not None):
            return None
        return self.draw(self.records, self.cfg.log_dir)
