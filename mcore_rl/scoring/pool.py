"""Scoring a step's responses: in-process, or in worker processes with a per-answer time limit.

Symbolic math can take seconds (or forever) on an adversarial answer. The machinery is
:class:`~mcore_rl.scoring.process_pool.TaskPool` (the multi-turn rollouts' tools run on it too). With
``reward.num_workers > 0``
each answer goes to one of N spawned worker processes; an answer still running after
``reward.timeout_s`` is abandoned, and its worker is killed and replaced, so one answer can never stall a
step. Workers are started once (each imports math-verify before taking work, so that start-up never counts
against an answer) and reused across steps; :meth:`RewardScorer.close` ends them. In the calling process
(``num_workers=0``) the same limit is an alarm signal that interrupts the scorer (main thread only; a scorer
stuck inside native code that ignores signals is only stopped by a worker's kill).

A scorer that raises, returns a non-number or a non-finite score, or runs past the limit: with
``reward.on_error=zero`` it scores 0 and is counted (one warning per kind per call); with ``raise`` the
call stops with a :class:`RewardError` naming the scorer and the row (one line, exit 1 from ``mcore-rl``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcore_rl.scoring.config import RewardConfig
from mcore_rl.scoring.process_pool import TaskLimits, TaskPool, WorkerStartError
from mcore_rl.scoring.registry import ScoreDispatch, ScorerError, scorer_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class RewardError(ScorerError):
    """A scorer failed under ``reward.on_error=raise``; the message names the scorer, the row and the cause."""


@dataclass(frozen=True)
class ScoreRequest:
    """One response to score, with verl's scorer arguments."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    """Where the prompt came from (e.g. ``train.parquet row 17``), for messages."""


@dataclass
class RewardOutput:
    """Scores of N responses, in request order."""

    scores: torch.Tensor
    """[N] float32: the reward of each response (0 where the scorer failed or timed out)."""
    extra: dict[str, torch.Tensor]
    """name -> [N] float32: numeric extra metrics of dict-returning scorers; NaN where absent."""
    num_errors: int = 0
    """Scorers that raised (scored 0)."""
    num_nonfinite: int = 0
    """Scores that were NaN or infinite (scored 0)."""
    num_timeouts: int = 0
    """Answers past ``reward.timeout_s`` (scored 0, their worker replaced)."""
    seconds: float = 0.0


Reduced = tuple[str, Any, dict[str, float]]
"""A scorer's return value as plain data: ``("ok", score, metrics)`` or ``(failure kind, message, {})``."""


def _scorer(cfg: RewardConfig, in_worker: bool) -> Callable[[ScoreRequest], Reduced]:
    """Built once where requests are scored (a worker process, or the caller): the dispatch; a worker warms
    math-verify before it says it is ready, so its seconds of import never time out an answer."""
    dispatch = ScoreDispatch(cfg)
    if in_worker:
        import math_verify  # noqa: F401

    def score(req: ScoreRequest) -> Reduced:
        # reduced where it is computed: a value of the user's own class (a file.py scorer's module exists in
        # the worker only) could not be unpickled by the driver, and both modes read the same plain floats
        return _reduce(dispatch(req.data_source, req.solution_str, req.ground_truth, req.extra_info))

    return score


class RewardScorer:
    """Scores requests with the configured dispatch; a context manager owning its worker processes."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.dispatch = ScoreDispatch(cfg)  # resolves every scorer spec now, so a bad one fails at start
        limits = TaskLimits(cfg.num_workers, cfg.timeout_s, what="scorer")
        self._pool = TaskPool(functools.partial(_scorer, cfg, cfg.num_workers > 0), limits)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.close()

    @property
    def _workers(self) -> list[Any]:
        """The pool's worker processes (started at the first call with ``reward.num_workers > 0``)."""
        return self._pool._workers

    def score(self, requests: list[ScoreRequest]) -> RewardOutput:
        start = time.perf_counter()
        try:
            raw = self._pool.run(requests)
        except WorkerStartError as err:
            raise RewardError(str(err)) from None
        output = self._collect(requests, raw)
        output.seconds = time.perf_counter() - start
        return output

    def _collect(self, requests: list[ScoreRequest], raw: list[tuple[str, Any]]) -> RewardOutput:
        import torch

        scores = torch.zeros(len(requests))
        extra: dict[str, torch.Tensor] = {}
        failures: dict[str, list[str]] = {"error": [], "nonfinite": [], "timeout": []}
        for i, ((status, value), req) in enumerate(zip(raw, requests, strict=True)):
            if status == "ok":
                status, value, metrics = value
                for name, metric in metrics.items():
                    extra.setdefault(name, torch.full((len(requests),), math.nan))[i] = metric
            if status != "ok":
                label = f"row {i} ({req.where or 'data_source ' + repr(req.data_source)}): {value}"
                if self.cfg.on_error == "raise":
                    name = scorer_name(self.cfg, req.data_source)
                    raise RewardError(
                        f"{name} failed on {label} (reward.on_error=zero scores such answers 0 and counts them)"
                    )
                failures[status].append(label)
                continue
            scores[i] = value
        for kind, labels in failures.items():
            if labels:
                log.warning("%d scorer %s(s) scored 0; first: %s", len(labels), kind, labels[0])
        return RewardOutput(
            scores,
            extra,
            num_errors=len(failures["error"]),
            num_nonfinite=len(failures["nonfinite"]),
            num_timeouts=len(failures["timeout"]),
        )


def _reduce(value: Any) -> Reduced:
    """A scorer's float or dict -> ``("ok" or a failure kind, the score or what went wrong, the dict's
    numeric entries as floats)``."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return "error", f"returned a dict without 'score' (keys: {', '.join(map(str, value))})", {}
        for name, metric in value.items():
            if name != "score" and isinstance(metric, (int, float)) and not isinstance(metric, bool):
                metrics[str(name)] = float(metric)
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "error", f"returned {value!r:.60}, not a number", metrics
    if not math.isfinite(score):
        return "nonfinite", f"returned {score}", metrics
    return "ok", score, metrics
