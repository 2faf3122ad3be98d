"""An :class:`~mcore_rl.io.output.OutputFolder` written by every rank of a job, managed by rank 0.

Rank 0 plans, creates the staging folder and commits; every rank writes its shards into the staging folder.
Both steps broadcast rank 0's outcome, so a failure on rank 0 (read-only folder, a concurrent writer) ends
every rank with the same one-line error instead of leaving the others waiting in a collective::

    output, staging = begin_collective(lambda: OutputFolder.plan(...), rank)   # output: None off rank 0
    ...every rank writes into staging...
    commit_collective(output, rank, finish)      # rank 0: finish() (side files), then commit
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from mcore_rl.io.errors import InputError, OutputError
from mcore_rl.io.output import OutputFolder


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    return str(err) if isinstance(err, InputError) else f"{type(err).__name__}: {err}"


def begin_collective(plan: Callable[[], OutputFolder], rank: int) -> tuple[OutputFolder | None, str]:
    """Rank 0 plans the output (checks) and creates its staging folder; every rank gets the staging path,
    or rank 0's error. Returns ``(output on rank 0 else None, staging path)``."""
    shared: list[str | None] = [None, None]
    output, unexpected = None, None
    if rank == 0:
        try:
            output = plan()
            shared[0] = output.begin()
        except (OSError, InputError) as err:
            shared[1] = _describe(err)
        except BaseException as err:  # a bug, an interrupt: its peers must not wait in the broadcast for it
            unexpected, shared[1] = err, f"rank 0 could not begin the output: {_describe(err)}"
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    if unexpected is not None:
        raise unexpected
    if shared[1] is not None:
        raise OutputError(shared[1])
    return output, str(shared[0])


def commit_collective(output: OutputFolder | None, rank: int, finish: Callable[[], None]) -> None:
    """Rank 0 runs ``finish`` and commits (aborting on failure); every rank learns the outcome."""
    failure: BaseException | None = None
    if rank == 0:
        assert output is not None
        try:
            finish()
            output.commit()
        except BaseException as err:
            output.abort()
            failure = err
    outcome = [None if failure is None else _describe(failure)]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise OutputError(f"rank 0 could not finish the output: {outcome[0]}")


def abort_collective(output: OutputFolder | None, rank: int) -> None:
    """After a failed write on any rank: rank 0 removes the staging folder."""
    if rank == 0 and output is not None:
        output.abort()
