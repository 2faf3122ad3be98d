"""Gradient all-reduce through shared memory for the CPU ranks of one data-parallel group on one host.

On CPU, torch.distributed's backend is gloo, whose all-reduce between processes of one host goes through TCP
loopback: the tiny workload's 15 MB of gradients took 9.7 ms (median; 6.3 at best) between two ranks on this
project's 2-vCPU VMs, about 1.5 GB/s against 14.85 GB/s for a plain copy, and 2.2 ms (1.9) through the mapping
below (40 alternating pairs, README "Ranks per node"). That all-reduce is what
made two single-threaded ranks' update slower than one rank's on the tiny workload (``bench/RESULTS.md``).
The ranks instead sum through one shared mapping (a file in ``/dev/shm``, unlinked as soon as every rank has
mapped it, so nothing is left behind): each rank copies in the parts of its buffer the others sum, sums its
own part of every rank's buffer and publishes it, and copies the others' sums back, with one barrier
(``csrc/host_reduce_cpu.cpp``: counters in the mapping, a dead peer named within milliseconds) between
phases. Every element is summed by one rank only, so all ranks hold bitwise the same result, and the same
result from run to run. Buffers larger than a slot go through in pieces of the slot's size.

:meth:`HostReduce.open` returns None, and the caller keeps gloo, wherever this cannot hold: one rank, no
native extension, ranks that do not share a process-id namespace (a dead peer could not be told apart), or a
``/dev/shm`` the ranks do not share or that has no room for the slots.

A rank that fails while its peers wait at a barrier stops them as a closed gloo connection would: its failure
guard (``failure.py``, :func:`abort_open_reducers`) writes its rank into the abort word of every mapping this
process holds, and each waiting peer raises an error naming it, then handles it in its own guard.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
LINE = 64
ABORT_OFFSET = 32
"""The abort word (int64) in the mapping's first line, after the 16-byte token: 0, or the aborting rank + 1."""
"""Each rank's barrier counter sits on its own cache line."""
ALIGN_ELEMENTS = 16
"""Each rank's part of a piece starts on a 64-byte boundary (fp32), so two ranks never write one line."""
DEFAULT_SLOT_BYTES = 16 << 20
"""Per rank: large enough that a piece's two barriers are noise, small enough for a 64 MiB ``/dev/shm``."""


@dataclass(frozen=True)
class _Peers:
    pid: int
    pid_namespace: str
    native: bool


def _native_barrier() -> Callable[..., None] | None:
    from mcore_rl.ops._native import extension_loaded

    if not extension_loaded():
        return None
    from mcore_rl import _C  # type: ignore[attr-defined]

    return getattr(_C, "host_barrier", None)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_OPEN: weakref.WeakSet[HostReduce] = weakref.WeakSet()
"""The reducers this process holds open: the mappings a failing rank must abort (as it severs gloo's pairs)."""


def abort_open_reducers() -> None:
    """Stop every reduction of every group this process holds a mapping of: peers waiting at a barrier raise an
    error naming this rank. Called when this rank fails (``failure.sever_connections``); never raises."""
    for reducer in list(_OPEN):
        reducer.abort()


def _header_bytes(world: int) -> int:
    return -(-(LINE + LINE * world) // mmap.PAGESIZE) * mmap.PAGESIZE


class HostReduce:
    """The shared slots and barrier of one group; :meth:`all_reduce_` sums a flat tensor across its ranks."""

    def __init__(
        self, mapping: mmap.mmap, rank: int, pids: list[int], slot_bytes: int, timeout_s: float = 0.0
    ) -> None:
        self.rank = rank
        self.world = len(pids)
        self.pids = pids
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        """How long a rank waits for the others at a barrier (0: no limit), as gloo's collective timeout."""
        self._mapping = mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._counters_address = self._bytes.data_ptr() + LINE
        self._abort_word = self._bytes[ABORT_OFFSET : ABORT_OFFSET + 8].view(torch.int64)
        self._header = _header_bytes(self.world)
        self._generation = 0
        self._barrier_fn = _native_barrier()
        self._last_layout: tuple[int, list[int]] | None = None
        """The element size and part bounds of the last piece reduced (see :meth:`_reduce_piece`)."""
        _OPEN.add(self)

    @classmethod
    def open(
        cls, group: dist.ProcessGroup | None, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 0.0
    ) -> HostReduce | None:
        """Collective over ``group``'s ranks: maps one shared file for them all, or returns None on every rank
        (see the module's note for when)."""
        world = dist.get_world_size(group)
        if world < 2:
            return None
        slot_bytes = max(LINE, -(-slot_bytes // LINE) * LINE)
        me = _Peers(os.getpid(), _pid_namespace(), _native_barrier() is not None)
        peers: list[_Peers | None] = [None] * world
        dist.all_gather_object(peers, me, group=group)
        if not me.pid_namespace or not all(
            p is not None and p.native and p.pid_namespace == me.pid_namespace for p in peers
        ):
            return None
        size = _header_bytes(world) + world * slot_bytes
        rank = dist.get_rank(group)
        created = _create(size) if rank == 0 else None
        shared: list[object] = [created]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        mapping = _attach(shared[0], size)  # type: ignore[arg-type]
        flags = torch.tensor([0 if mapping is None else 1], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        if rank == 0 and shared[0] is not None:  # every rank has mapped it or given up: the name goes
            os.unlink(shared[0][0])  # type: ignore[index]
        if int(flags.item()) == 0:
            if mapping is not None:
                mapping.close()
            return None
        return cls(mapping, rank, [p.pid for p in peers], slot_bytes, timeout_s)  # type: ignore[union-attr,arg-type]

    def _barrier(self) -> None:
        self._generation += 1
        assert self._barrier_fn is not None  # open() makes one only where every rank has the barrier
        self._barrier_fn(
            self._counters_address,
            self._abort_word.data_ptr(),
            self.rank,
            self.world,
            self._generation,
            self.pids,
            float(self.timeout_s),
        )

    def _slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        begin = self._header
        return [
            self._bytes[begin + r * self.slot_bytes : begin + (r + 1) * self.slot_bytes].view(dtype)
            for r in range(self.world)
        ]

    def _bounds(self, numel: int) -> list[int]:
        share = -(-numel // self.world)
        share = -(-share // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        return [min(numel, r * share) for r in range(self.world + 1)]

    def all_reduce_(self, flat: torch.Tensor, average: bool = False, op: str = "sum") -> None:
        """Reduces ``flat`` (1-D, contiguous, on CPU) over the group's ranks in place: ``op`` "sum" (``average``
        divides the sum by the number of ranks) or "max"; every rank must call it with a tensor of the same
        length and dtype."""
        if flat.dim() != 1 or not flat.is_contiguous() or flat.device.type != "cpu":
            raise ValueError("host all-reduce: needs a flat contiguous CPU tensor")
        if op not in ("sum", "max"):
            raise ValueError(f"host all-reduce: op {op!r} is not 'sum' or 'max'")
        slots = self._slots(flat.dtype)
        piece_len = slots[0].numel()
        for start in range(0, flat.numel(), piece_len):
            self._reduce_piece(flat[start : start + piece_len], slots, op)
        if average:
            flat.div_(self.world)

    def _reduce_piece(self, piece: torch.Tensor, slots: list[torch.Tensor], op: str) -> None:
        bounds = self._bounds(piece.numel())
        layout = (piece.element_size(), bounds)
        if self._last_layout is not None and layout != self._last_layout:
            # Parts laid out differently from the last piece's: this rank's first writes could land where the
            # others still read the last piece's sums, so wait until they are done.
            self._barrier()
        self._last_layout = layout
        others = [r for r in range(self.world) if r != self.rank]
        mine = slots[self.rank]
        for r in others:  # the parts the other ranks reduce
            mine[bounds[r] : bounds[r + 1]].copy_(piece[bounds[r] : bounds[r + 1]])
        self._barrier()
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        own = piece[lo:hi]
        for r in others:
            if op == "sum":
                own.add_(slots[r][lo:hi])
            else:
                torch.maximum(own, slots[r][lo:hi], out=own)
        mine[lo:hi].copy_(own)  # this rank's part of the result, for the others
        self._barrier()
        for r in others:
            piece[bounds[r] : bounds[r + 1]].copy_(slots[r][bounds[r] : bounds[r + 1]])
        # No barrier here when the next piece has the same parts: its first writes touch only the parts of
        # this rank's slot that the others finished reading before the barrier above, and this rank's own part
        # only after the next piece's first barrier.

    def abort(self) -> None:
        """Stop the group's reductions: every rank waiting at a barrier of this mapping, now or later, raises
        an error naming this rank. The mapping is unusable afterwards, as severed gloo pairs are."""
        if not self._mapping.closed:
            self._abort_word[0] = self.rank + 1  # one aligned 8-byte store: peers read it whole

    def close(self) -> None:
        """Unmaps the slots; the object is unusable afterwards."""
        _OPEN.discard(self)
        del self._bytes, self._abort_word
        self._mapping.close()


def open_for_buckets(
    group: dist.ProcessGroup | None, largest_bucket_bytes: int, timeout_s: float = 0.0
) -> HostReduce | None:
    """:meth:`HostReduce.open` with slots the size of the group's largest gradient bucket, at most
    :data:`DEFAULT_SLOT_BYTES` (larger buckets go through in pieces)."""
    return HostReduce.open(group, min(DEFAULT_SLOT_BYTES, largest_bucket_bytes), timeout_s)


def _create(size: int) -> tuple[str, bytes] | None:
    """A fresh file of ``size`` bytes in ``/dev/shm`` with its pages reserved (a full tmpfs fails here, not
    with SIGBUS at first touch) and a random token in its first bytes; None when that is not possible."""
    if not os.path.isdir(SHM_DIR):
        return None
    path = os.path.join(SHM_DIR, f"mcore_rl-grads-{os.getpid()}-{secrets.token_hex(6)}")
    token = secrets.token_bytes(16)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path, token


def _attach(created: tuple[str, bytes] | None, size: int) -> mmap.mmap | None:
    """The shared mapping of the file rank 0 created, if this rank sees that very file (same token)."""
    if created is None:
        return None
    path, token = created
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(fd)
    if mapping[: len(token)] != token:
        mapping.close()
        return None
    return mapping
