"""Recovery from a lost worker: what counts as one, and what the run's log keeps of it.

A rank whose process is gone (killed, out of memory, its node left the cluster: ``WorkerError.kind ==
"died"``) does not come back on its own, and every other rank of its world waits in a collective for it. The
driver (``Trainer.fit``) then stops every worker group, starts them again on the resources Ray has and continues
from the last run checkpoint through the same path a resumed run takes (from the start when none was saved),
at most ``trainer.max_restarts`` times. An error a rank raises (a bug, bad input, a NaN loss) or a hung phase is
never retried: it would fail the same way again.

The steps between that checkpoint and the fault run again from the same seeds and data position, so they equal
the uninterrupted run's; :func:`kept_records` drops the superseded records from the run's in-memory records
(``metrics.jsonl`` is append-only: a ``recovery`` record marks where the steps after it start again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


def is_lost_worker(err: BaseException) -> bool:
    """A rank's process is gone (``controller.WorkerError`` of kind ``died``)."""
    return getattr(err, "kind", None) == "died"


@dataclass(frozen=True)
class Recovery:
    """One recovery from a lost worker."""

    restart: int
    """1 for the run's first recovery."""
    rank: int
    """The rank that was lost (of the group that was waited on)."""
    phase: str
    """The worker method the driver was waiting on."""
    failed_at_step: int
    """The RL step that was running (0: before RL, e.g. the SFT warm start)."""
    resumed_step: int
    """The step of the checkpoint the run continued from (0: from the start)."""
    seconds: float
    """From the fault being noticed to the workers ready with the checkpoint loaded."""

    @property
    def steps_lost(self) -> int:
        """RL steps run again (those after the checkpoint, the failed one included)."""
        return max(self.failed_at_step - self.resumed_step, 0)

    def line(self, max_restarts: int) -> str:
        where = f"step {self.failed_at_step}" if self.failed_at_step else "before the first RL step"
        source = f"from step {self.resumed_step}" if self.resumed_step else "from the start"
        return (
            f"rank {self.rank} was lost in {self.phase} at {where}; workers restarted and resumed {source} in "
            f"{self.seconds:.1f} s (RL steps run again: {self.steps_lost}; restart {self.restart} of "
            f"{max_restarts}, trainer.max_restarts)"
        )

    def record(self) -> dict[str, Any]:
        """The ``recovery`` record of ``metrics.jsonl`` (its step: the step the run continues after)."""
        return {
            "restart": self.restart,
            "rank": self.rank,
            "phase": self.phase,
            "failed_at_step": self.failed_at_step,
            "steps_lost": self.steps_lost,
            "recovery_s": self.seconds,
            "unix_time": time.time(),
        }


def kept_records(
    records: list[dict[str, Any]], resumed_step: int, from_checkpoint: bool
) -> list[dict[str, Any]]:
    """The records still valid after a recovery to ``resumed_step``: from a checkpoint, everything before its RL
    steps and the RL steps up to it; from the start, only earlier recoveries."""
    if not from_checkpoint:
        return [r for r in records if r["stage"] == "recovery"]
    return [r for r in records if r["stage"] != "rl" or r["step"] <= resumed_step]
