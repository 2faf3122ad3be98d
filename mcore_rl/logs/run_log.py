"""Where a run's metrics go (RL, SFT and DPO alike): one JSON object per record in ``metrics.jsonl``,
TensorBoard scalars, a live progress bar, and at the end a PNG drawn from the records (``plots.py``), those of
a resumed run's earlier processes read back so that it covers the whole run."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from mcore_rl.io.errors import note
from mcore_rl.logs.config import LoggingConfig
from mcore_rl.logs.generations import GENERATIONS_FILE, append_generations
from mcore_rl.logs.jsonl import end_torn_line, json_line
from mcore_rl.logs.trackers import Tracker, open_trackers

METRICS_FILE = "metrics.jsonl"
TIMESTAMP_KEY = "time/timestamp"
RECOVERY, RESUME = "recovery", "resume"
"""Marker records where a run's steps start again after step N: an in-process recovery (with what it did,
``mcore_rl/trainer/recovery.py``) and a resumed run; the records of later steps before them are superseded."""


def previous_log(cfg: LoggingConfig) -> str | None:
    """The ``metrics.jsonl`` of an earlier run in ``cfg.log_dir`` that a fresh run (not a resume) would start
    over, or None. A run refuses to start over one (:func:`mcore_rl.config.run_folder.check_run_folders`)."""
    path = os.path.join(cfg.log_dir, METRICS_FILE)
    return path if cfg.jsonl and os.path.isfile(path) and os.path.getsize(path) > 0 else None


def keep_aside(path: str) -> str:
    """Rename ``path`` (``metrics.jsonl``) to the first free ``metrics.<k>.jsonl`` beside it; returns that."""
    stem, ext = os.path.splitext(path)
    k = 1
    while os.path.lexists(f"{stem}.{k}{ext}"):
        k += 1
    os.rename(path, f"{stem}.{k}{ext}")
    return f"{stem}.{k}{ext}"


Plot = Callable[[list[dict[str, Any]], str], str | None]
"""(records, log folder) -> the PNG written, or None (nothing to draw, or matplotlib missing)."""

Kept = Callable[[list[dict[str, Any]], int], list[dict[str, Any]]]
"""(records, step) -> those that still stand when the run's steps start again after ``step`` (a resume or a
recovery): the records of later steps are superseded by the steps run again."""


def records_up_to(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The default :data:`Kept`, for a run whose every stage is on its step axis (DPO's ``train`` and
    ``eval``): the records at steps up to ``step``. RL's SFT warm start counts its own steps: RL passes
    :func:`mcore_rl.trainer.recovery.kept_records`."""
    return [r for r in records if r["step"] <= step]


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of the ``metrics.jsonl`` at ``path`` ([] without one); a line cut short by a crash
    mid-write, or anything else that is not a record, is skipped."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (
                isinstance(record, dict)
                and isinstance(record.get("stage"), str)
                and isinstance(record.get("step"), int)
            ):
                records.append(record)
    return records


def standing_records(records: list[dict[str, Any]], progress_stage: str, kept: Kept) -> list[dict[str, Any]]:
    """The records of an append-only ``metrics.jsonl`` (in the order written) that still stand at its end.
    Where the run's steps started again, ``kept`` drops those they superseded: at a ``recovery`` record (step
    s: the run continued after s, ``mcore_rl/trainer/recovery.py``), and where a resumed run's first
    ``progress_stage`` record is at a step not after the last one (it continued after that step - 1). Without
    the second, a run resumed twice, interrupted past its checkpoint each time, would draw steps twice."""
    standing: list[dict[str, Any]] = []
    last = -1
    for record in records:
        stage, step = record.get("stage"), record["step"]
        if stage in (RECOVERY, RESUME):
            standing, last = kept(standing, step), -1
            if stage == RESUME:  # a marker without metrics
                continue
        elif stage == progress_stage:
            if step <= last:
                standing = kept(standing, step - 1)
            last = step
        standing.append(record)
    return standing


def emit_record(jsonl: Any, tb: Any, stage: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """``{"stage", "step", **metrics, "time/timestamp"}`` appended to the open JSONL file (flushed, so a crash
    keeps it) and the metrics' finite numbers to TensorBoard as ``stage/key``; either sink may be None. Returns
    the record. ``time/timestamp`` is the wall clock when the record was written (Unix seconds): steps line up
    with outside events (a node's load, a preemption) and the time between records is the whole step, driver
    included (TensorBoard keeps its own wall time)."""
    record = {"stage": stage, "step": step, **metrics, TIMESTAMP_KEY: round(time.time(), 3)}
    if jsonl is not None:
        jsonl.write(json_line(record))
        jsonl.flush()
    if tb is not None:
        # a record that says when it was taken (the held-out tests before and after the SFT warm start, both
        # at step 0) gets its own tags: TensorBoard showed two points at one step under one name
        tag = f"{stage}/{metrics['when']}" if isinstance(metrics.get("when"), str) else stage
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                tb.add_scalar(f"{tag}/{key}", value, step)
    return record


BAR_MIN_INTERVAL_S = 2.0
"""Seconds between two redraws of a progress bar (tqdm's ``mininterval``)."""


class RunLog:
    """Writes records of ``{"stage": ..., "step": ..., metrics...}``; :meth:`close` draws the plot.

    ``progress_stage``: the stage whose ``total_steps`` a progress bar counts; ``stage_steps`` gives other
    stages (stage -> its most steps, e.g. the SFT warm start before RL) a bar of their own. Each bar opens at
    its stage's first record and the one before it closes there, so the console shows one line per stage
    finished and a live one, each with the ``bar_metrics`` (label -> record key) its records have.

    ``start_step`` > 0 continues a resumed run: the JSONL is appended to, the bar starts there and the plot
    draws the earlier records that still stand (:attr:`earlier`, by the driver's rule ``kept``) before this
    process's. A fresh run (``start_step`` 0) never writes over an earlier run's JSONL: the drivers refuse it
    before they start, and a caller that did not is told the old file was kept aside (``metrics.<k>.jsonl``),
    as raising here, on rank 0 alone mid-run, would leave its peers waiting. ``enabled=False`` (ranks other
    than 0 of a run they share) writes nothing."""

    def __init__(
        self,
        cfg: LoggingConfig,
        total_steps: int,
        *,
        progress_stage: str = "rl",
        stage_steps: Mapping[str, int] | None = None,
        bar_metrics: Mapping[str, str] | None = None,
        plot: Plot | None = None,
        start_step: int = 0,
        enabled: bool = True,
        samples: Callable[[], list[dict[str, Any]]] | None = None,
        kept: Kept = records_up_to,
    ) -> None:
        self.cfg = cfg
        self.samples = samples
        """The validation samples taken since the last record (``logging.log_val_generations``), appended to
        ``generations.jsonl`` with the next record's stage and step."""
        self._trackers: list[Tracker] = []
        self.progress_stage = progress_stage
        self._stage_steps = {**(stage_steps or {}), progress_stage: total_steps}
        self._start_step = start_step
        self._bar_stage: str | None = None
        self.bar_metrics = dict(bar_metrics or {k: k for k in ("reward", "loss", "val_accuracy")})
        self.draw = plot
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        """This process's records."""
        self.earlier: list[dict[str, Any]] = []
        """A resumed run's records from before ``start_step`` that still stand, read back from ``metrics.jsonl``
        (``kept``): the plot draws them with :attr:`records`, so that it covers the whole run."""
        self._jsonl: Any = None
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.jsonl_path = os.path.join(cfg.log_dir, METRICS_FILE)
        if start_step:
            earlier = standing_records(read_records(self.jsonl_path), progress_stage, kept)
            self.earlier = kept(earlier, start_step)  # those after it were lost with the interruption
        if not start_step and previous_log(cfg) is not None:
            note(f"kept the earlier run's {self.jsonl_path} as {keep_aside(self.jsonl_path)}")
        if cfg.jsonl:
            if start_step:
                end_torn_line(self.jsonl_path)
                end_torn_line(os.path.join(cfg.log_dir, GENERATIONS_FILE))
            self._jsonl = open(self.jsonl_path, "a" if start_step else "w")  # noqa: SIM115
            if (
                start_step
            ):  # the steps after the checkpoint run again: readers drop their earlier records here
                emit_record(self._jsonl, None, RESUME, start_step, {})
        if cfg.tensorboard:
            self._open_tensorboard(start_step)
        self._trackers = open_trackers(cfg)  # W&B, MLflow (logging.wandb / logging.mlflow)

    def _open_tensorboard(self, after_step: int) -> None:
        """A writer whose events after ``after_step`` replace those an earlier process (or this one, before a
        recovery) wrote: TensorBoard showed the steps run again twice."""
        from torch.utils.tensorboard import SummaryWriter

        if self._tb is not None:
            self._tb.close()
        purge = {"purge_step": after_step + 1} if after_step else {}
        self._tb = SummaryWriter(os.path.join(self.cfg.log_dir, "tensorboard"), **purge)

    def write(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if stage == RECOVERY and self._tb is not None:
            self._open_tensorboard(step)
        self.records.append(emit_record(self._jsonl, self._tb, stage, step, metrics))
        for tracker in self._trackers:
            tracker.log(stage, step, metrics)
        if self.samples is not None:
            append_generations(self.cfg.log_dir, self._tb, stage, step, self.samples())
        if self.cfg.progress_bar and stage in self._stage_steps:
            self._advance_bar(stage, step, metrics)

    def _advance_bar(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        if stage != self._bar_stage:
            from tqdm import tqdm

            if self._bar is not None:
                self._bar.close()  # stays on the console: the stage's last step and metrics
            initial = self._start_step if stage == self.progress_stage else 0
            total = self._stage_steps[stage]
            self._bar = tqdm(
                total=total, initial=initial, desc=stage, unit="step", mininterval=BAR_MIN_INTERVAL_S
            )
            self._bar_stage = stage
            self._shown: dict[str, str] = {}
        # Merged, so a metric logged every few steps (val_accuracy) stays on the line between its steps; set
        # before update(), which is what redraws the line, so the line shows this step's values.
        self._shown.update({k: f"{metrics[v]:.3f}" for k, v in self.bar_metrics.items() if v in metrics})
        self._bar.set_postfix(self._shown, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def close(self) -> str | None:
        """Flush everything; returns the plot's path (None when off, disabled, or nothing was drawn)."""
        for handle in (self._bar, self._jsonl, self._tb, *self._trackers):
            if handle is not None:
                handle.close()
        if not (self.enabled and self.cfg.plot and self.draw is not None):
            return None
        return self.draw(self.earlier + self.records, self.cfg.log_dir)
