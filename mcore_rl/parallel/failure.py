"""Failure propagation: one rank's exception stops its peers within seconds, and their errors name it.

gloo and NCCL collectives block until every member joins or the collective timeout (30 min) passes. A rank
that raises never joins, so without help its peers wait that long and then fail with an error that does not
say who failed or why. Three pieces, all off the normal path, fix that:

1. A *failure board* on the c10d store the world rendezvoused on (torchrun, Ray actors and the test pool all
   have one): the first failure wins one key, holding ``rank r during <what>: <Type>: <message>``.
2. A guarded region (:meth:`FailureGuard.guard`; the hybrid transitions, train and rollout steps use it).
   When its body raises, the rank posts to the board and then *severs* its connections: every peer blocked
   on it fails at once ("connection closed"). That peer is inside its own guard, reads the board, raises
   :class:`PeerFailureError` naming the first failing rank and severs in turn, so ranks blocked on blocked ranks
   follow within a round trip each.
3. A watchdog thread reads the board once per ``poll_s``: a rank that waits on nobody (e.g. decoding on its
   own rollout replica) raises at its next guard boundary instead of carrying on.

Normal-path cost: an attribute read at the entry and exit of a guarded region, and the watchdog's one store
lookup per ``poll_s``. After a failure the world's connections are gone (and on NCCL its communicators are
aborted): every rank calls :func:`rejoin_world` to get a fresh world over the same store, or the job restarts.

Severing on gloo uses the one way gloo offers to close a live connection from Python: a receive that times
out closes its pair (and the peer's pending operations on it fail at once). NCCL aborts its communicators;
NCCL peers are unblocked by their own watchdog aborting theirs. Only the gloo path runs in the CPU tests.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.parallel.host_reduce import abort_open_reducers

logger = logging.getLogger(__name__)

_SEVER_TAG = 0x5E7E4  # a tag no real message uses: these receives exist only to time out
_SEVER_WAIT = datetime.timedelta(milliseconds=1)


@dataclass(frozen=True)
class FailureReport:
    """The first failure of a world, as posted on the board."""

    rank: int
    """Global rank that raised first."""
    what: str
    """The guarded region it was in, e.g. 'reshard' or 'train_step'."""
    error: str
    """``Type: message`` of its exception."""

    def encode(self) -> str:
        return f"{self.rank}\n{self.what}\n{self.error}"

    @classmethod
    def decode(cls, raw: bytes) -> FailureReport:
        rank, what, error = raw.decode().split("\n", 2)
        return cls(int(rank), what, error)

    def __str__(self) -> str:
        return f"rank {self.rank} failed during {self.what}: {self.error}"


class PeerFailureError(RuntimeError):
    """Another rank failed; this rank stopped because of it. ``report`` names that rank and its exception."""

    def __init__(self, report: FailureReport, rank: int, what: str) -> None:
        super().__init__(f"{report} (rank {rank} stopped during {what})")
        self.report = report


class FailureGuard:
    """The board, the watchdog and the guarded regions of one rank in one world (see the module docstring).

    Built by :class:`~mcore_rl.parallel.context.ParallelContext`; ``key`` must be the same on every rank and
    new for each context, so a failure of one context does not poison the next.
    """

    def __init__(self, store: Any, key: str, rank: int, poll_s: float = 0.5) -> None:
        self.store = store
        self.key = key
        self.rank = rank
        self.poll_s = poll_s
        self.failure: FailureReport | None = None
        """Set (once) by the watchdog or a failing guard; read at every guard boundary."""
        self._depth = 0
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"failure-watchdog-{rank}", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        self._stop.set()
        self._watchdog.join(timeout=5 * self.poll_s)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the body; if it raises (or a peer already failed), tell the peers and stop them, and raise
        :class:`PeerFailureError` naming the first failing rank (or the body's own exception on that rank)."""
        self._depth += 1
        try:
            self._raise_if_failed(what)
            yield
            self._raise_if_failed(what)
        except Exception as err:
            self._handle(err, what)
            raise
        finally:
            self._depth -= 1

    def _raise_if_failed(self, what: str) -> None:
        if self.failure is not None and self.failure.rank != self.rank:
            raise PeerFailureError(self.failure, self.rank, what)

    def _handle(self, err: Exception, what: str) -> None:
        """Post (the first post wins), sever, and turn a consequence of a peer's failure into PeerFailureError."""
        if getattr(err, "_mcore_rl_handled", False):  # an inner guard already did all of this
            return
        err._mcore_rl_handled = True  # type: ignore[attr-defined]
        if isinstance(err, PeerFailureError):
            first = err.report
        else:
            mine = FailureReport(self.rank, what, f"{type(err).__name__}: {err}".strip())
            first = self.post(mine)
        self.failure = self.failure or first
        sever_connections()
        if first.rank != self.rank and not isinstance(err, PeerFailureError):
            logger.error("rank %d stopped: %s", self.rank, first)
            raise PeerFailureError(first, self.rank, what) from err
        if first.rank == self.rank:
            err.add_note(f"rank {self.rank} reported this failure to its peers and severed its connections")

    def post(self, report: FailureReport) -> FailureReport:
        """Post ``report`` unless a failure is already posted; returns the one on the board."""
        first = FailureReport.decode(self.store.compare_set(self.key, "", report.encode()))
        self.failure = self.failure or first
        return first

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if not self.store.check([self.key]):
                    continue
                report = FailureReport.decode(self.store.get(self.key))
            except Exception:  # the store went away: the world is shutting down
                return
            if report.rank != self.rank and self.failure is None:
                self.failure = report
                logger.error("rank %d learned: %s", self.rank, report)
                if self._depth > 0 and _uses_nccl():
                    # A blocked NCCL kernel never sees the peer's abort; only aborting here frees this rank.
                    sever_connections()
            return


def _uses_nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"


def sever_connections() -> None:
    """Close every connection of this rank in every group it belongs to, so that peers blocked on it fail now.

    Destroys the world's usability on this rank (see :func:`rejoin_world`); never raises. Peers waiting for this
    rank at a host all-reduce's barrier (``host_reduce.py``: shared memory, no connection to close) are stopped
    through the mapping's abort word.
    """
    abort_open_reducers()
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    me = dist.get_rank()
    works = []
    for group in list(distributed_c10d._world.pg_map):
        ranks = dist.get_process_group_ranks(group)
        if me not in ranks:
            continue
        try:
            if dist.get_backend(group) != "gloo":
                group.abort()
                continue
        except Exception:  # already aborted, or a backend without abort: nothing more to do here
            continue
        for peer, index in ((r, i) for i, r in enumerate(ranks) if r != me):
            try:  # post them all first: their timeouts then run concurrently
                works.append(group.recv([torch.empty(1)], index, _SEVER_TAG))
            except Exception:  # the peer closed this pair already
                logger.debug("rank %d: pair to %d already closed", me, peer)
    for work in works:
        with contextlib.suppress(Exception):
            work.wait(_SEVER_WAIT)


_generation = 0


def rejoin_world() -> None:
    """Collective over every rank: leave a world whose connections a failure severed and join a fresh one of
    the same ranks over the same store (a new key prefix per rejoin). No ParallelContext may be live."""
    global _generation
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    dist.destroy_process_group()
    _generation += 1
    prefixed = dist.PrefixStore(f"mcore_rl/rejoin/{_generation}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size)
