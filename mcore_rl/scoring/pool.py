"""Scoring a step's responses: in-process, or in worker processes with a per-answer time limit.

Symbolic math can take seconds (or forever) on an adversarial answer. With ``reward.num_workers > 0``
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

import contextlib
import logging
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from mcore_rl.scoring.config import RewardConfig
from mcore_rl.scoring.registry import ScoreDispatch, ScorerError, scorer_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_START_LIMIT_S = 120.0
"""A worker that has not finished importing after this long is a broken environment, not a slow answer."""


class RewardError(ScorerError):
    """A scorer failed under ``reward.on_error=raise``; the message names the scorer, the row and the cause."""


class _Timeout(BaseException):
    """The alarm of an in-process answer past ``reward.timeout_s`` (a BaseException: a scorer's own
    ``except Exception`` does not swallow it)."""


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


def _evaluate(dispatch: ScoreDispatch, req: ScoreRequest, timeout_s: float | None = None) -> tuple[str, Any]:
    """One answer's score; ``timeout_s`` (under :func:`_alarms`) interrupts it past the limit."""
    try:
        if timeout_s is not None:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return "ok", dispatch(req.data_source, req.solution_str, req.ground_truth, req.extra_info)
        finally:
            if timeout_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return "timeout", f"over {timeout_s} s"
    except Exception as err:  # a user scorer may raise anything; it is reported, not fatal here
        return "error", f"{type(err).__name__}: {err}"


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _Timeout


@contextlib.contextmanager
def _alarms() -> Iterator[bool]:
    """SIGALRM interrupts an answer past its limit while the block runs (main thread only: yields whether it
    is armed)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _worker_main(conn: Connection, cfg: RewardConfig) -> None:
    """Worker process: build the dispatch, warm math-verify, then score ``(index, request)`` until None."""
    dispatch = ScoreDispatch(cfg)
    import math_verify  # noqa: F401  (imported before 'ready' so its seconds of import never time out)

    conn.send("ready")
    while (message := conn.recv()) is not None:
        index, request = message
        conn.send((index, *_evaluate(dispatch, request)))


class _Worker:
    def __init__(self, ctx: Any, cfg: RewardConfig) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, cfg), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, float] | None = None
        """(request index, deadline) while busy."""

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardScorer:
    """Scores requests with the configured dispatch; a context manager owning its worker processes."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.dispatch = ScoreDispatch(cfg)  # resolves every scorer spec now, so a bad one fails at start
        self._ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and memory
        self._workers: list[_Worker] = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for worker in self._workers:
            if worker.process.is_alive():
                with contextlib.suppress(OSError):  # already gone: nothing to tell it
                    worker.conn.send(None)
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []

    def score(self, requests: list[ScoreRequest]) -> RewardOutput:
        start = time.perf_counter()
        if self.cfg.num_workers == 0:
            with _alarms() as armed:
                limit = self.cfg.timeout_s if armed else None
                raw = [_evaluate(self.dispatch, r, limit) for r in requests]
        else:
            raw = self._score_in_workers(requests)
        output = self._collect(requests, raw)
        output.seconds = time.perf_counter() - start
        return output

    def _score_in_workers(self, requests: list[ScoreRequest]) -> list[tuple[str, Any]]:
        while len(self._workers) < self.cfg.num_workers:
            self._workers.append(_Worker(self._ctx, self.cfg))
        results: list[tuple[str, Any] | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        while pending or any(w.task for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    worker.conn.send((index, requests[index]))
                    worker.task = (index, time.monotonic() + self.cfg.timeout_s)
            self._wait_and_receive(results)
        return [r if r is not None else ("error", "no result") for r in results]

    def _wait_and_receive(self, results: list[tuple[str, Any] | None]) -> None:
        """Wait for the first answer or deadline; record answers, kill and replace late or dead workers."""
        now = time.monotonic()
        deadlines = [w.task[1] for w in self._workers if w.task] or [now + 1.0]
        by_conn = {id(w.conn): w for w in self._workers}
        for conn in wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - now)):
            worker = by_conn[id(conn)]
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=5)
                died = f"worker process died (exit code {worker.process.exitcode})"
                if not worker.ready:  # it never took work: replacing it would loop forever
                    raise RewardError(f"a scorer worker failed to start: {died}") from None
                self._replace(worker, results, died)
                continue
            if message == "ready":
                worker.ready = True
            else:
                index, status, value = message
                results[int(index)] = (str(status), value)
                worker.task = None
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task and worker.task[1] <= now:
                self._replace(worker, results, None)
            elif not worker.ready and now - worker.started > _START_LIMIT_S:
                raise RewardError(f"a scorer worker did not start within {_START_LIMIT_S:.0f} s")

    def _replace(self, worker: _Worker, results: list[tuple[str, Any] | None], error: str | None) -> None:
        if worker.task is not None:
            index = worker.task[0]
            results[index] = ("error", error) if error else ("timeout", f"over {self.cfg.timeout_s} s")
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.cfg)

    def _collect(self, requests: list[ScoreRequest], raw: list[tuple[str, Any]]) -> RewardOutput:
        import torch

        scores = torch.zeros(len(requests))
        extra: dict[str, torch.Tensor] = {}
        failures: dict[str, list[str]] = {"error": [], "nonfinite": [], "timeout": []}
        for i, ((status, value), req) in enumerate(zip(raw, requests, strict=True)):
            if status == "ok":
                status, value = _unpack(value, extra, i, len(requests))
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


def _unpack(value: Any, extra: dict[str, torch.Tensor], index: int, num: int) -> tuple[str, Any]:
    """A scorer's float or dict -> ("ok", float) or a failure; numeric dict entries go to ``extra``."""
    import torch

    if isinstance(value, dict):
        if "score" not in value:
            return "error", f"returned a dict without 'score' (keys: {', '.join(map(str, value))})"
        for name, metric in value.items():
            if name != "score" and isinstance(metric, (int, float)) and not isinstance(metric, bool):
                extra.setdefault(name, torch.full((num,), math.nan))[index] = float(metric)
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "error", f"returned {value!r:.60}, not a number"
    if not math.isfinite(score):
        return "nonfinite", f"returned {score}"
    return "ok", score
