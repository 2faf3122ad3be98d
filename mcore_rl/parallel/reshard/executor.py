"""Run a :class:`ReshardPlan` over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Each rank allocates only its own rollout shards, copies what it keeps from its training shards, and then
exchanges flat messages round by round, following the plan's global schedule (``ReshardPlan.rounds``): every
(sender, receiver) pair exchanges at most one message per round, so batched isend/irecv cannot mismatch
messages, and no rank sends plus receives more than ``max_inflight_bytes`` in one round.

All copies are block-copy tables (see :mod:`mcore_rl.ops.pack`) run by the ``pack_copy`` / ``unpack_copy``
kernels: one call packs a whole message (casting to the rollout dtype on the way), one call drains it into
the rollout shards, one call per kept parameter copies the local part. The tables are built once per
(plan, rank, sizes) by :func:`execution_schedule` and memoised on the plan, since the RL loop reshards every
step. Messages are carved from one staging buffer sized to this rank's largest round, allocated once per
call, so the memory in flight is exactly that buffer.

Output tensors use megatron's shard layout for the rollout TP degree (``tp_shard`` of the full tensor with
``tp_g``); ``to_rollout_layout`` in the rollout engine turns them into its own names and fused layouts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.ops.pack import pack_copy, unpack_copy
from mcore_rl.ops.reference import TABLE_COLUMNS
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.parallel.reshard.plan import Bucket, Interval, ParamSpec, ReshardPlan, local_units, train_split
from mcore_rl.parallel.sharding import ShardKind

Block = tuple[int, int, int, int]  # (offset, rows, cols, row stride), in elements of a contiguous shard


@dataclass(frozen=True)
class ReshardStats:
    seconds: float
    bytes_sent: int
    bytes_received: int
    peak_buffer_bytes: int
    """Largest total of send + receive buffers alive at once on this rank (the staging buffer)."""


@dataclass(frozen=True)
class Message:
    """One bucket this rank sends or receives in a round."""

    peer: int
    send: bool
    offset: int
    """Elements from the start of the staging buffer."""
    numel: int
    names: tuple[str, ...]
    """Tensors the table's first column indexes: training shards to pack (send) or rollout shards (receive)."""
    table: torch.Tensor
    """Copy table, int64 [K, 7]: tensor blocks <-> the message (see :mod:`mcore_rl.ops.pack`)."""


@dataclass(frozen=True)
class ExecutionSchedule:
    """Everything one rank does in :func:`execute_plan`, as data: built once, reused every weight sync."""

    local_copies: tuple[tuple[str, torch.Tensor], ...]
    """(parameter, table) of the parts this rank keeps: training shard (source 0) -> rollout shard."""
    rounds: tuple[tuple[Message, ...], ...]
    """The rounds of the global schedule this rank takes part in, in order."""
    staging_numel: int
    """Elements of the staging buffer: this rank's largest round."""

    def numel(self, send: bool) -> int:
        return sum(m.numel for messages in self.rounds for m in messages if m.send is send)


def shard_shape(spec: ParamSpec, tp: int, vocab_divisible_by: int = 128) -> tuple[int, ...]:
    """Shape of one TP shard of ``spec`` at degree ``tp`` in megatron's layout (training or rollout side)."""
    if spec.kind is ShardKind.REPLICATED:
        return spec.shape
    shape = list(spec.shape)
    if spec.kind is ShardKind.VOCAB:
        shape[0] = padded_vocab_size(spec.shape[0], tp, vocab_divisible_by) // tp
    else:
        shape[spec.split_dim] //= tp
    return tuple(shape)


def _tp(spec: ParamSpec, tp: int, coord: int) -> tuple[int, int]:
    """(tp size, coordinate) as seen by ``local_units``: replicated params are one whole shard."""
    return (1, 0) if spec.kind is ShardKind.REPLICATED else (tp, coord)


def _block(spec: ParamSpec, shape: tuple[int, ...], local_unit: int, num_units: int) -> Block:
    """``shard_view(spec, shard, local_unit, num_units)`` of a contiguous ``shard`` of ``shape`` as one 2-D
    block: one row per index of the dims before ``split_dim`` (a single contiguous run when there are none)."""
    outer = inner = 1
    for size in shape[: spec.split_dim]:
        outer *= size
    for size in shape[spec.split_dim + 1 :]:
        inner *= size
    cols = num_units * spec.unit_rows * inner
    stride = shape[spec.split_dim] * inner if outer > 1 else cols
    return local_unit * spec.unit_rows * inner, outer, cols, stride


def _shard_block(spec: ParamSpec, tp: int, coord: int, vocab_divisible_by: int, iv: Interval) -> Block:
    """Where interval ``iv`` sits in the TP shard ``coord`` of ``tp`` (replicated params: the whole tensor)."""
    size, coord = _tp(spec, tp, coord)
    offset = local_units(spec, size, coord, iv, vocab_divisible_by)
    return _block(spec, shard_shape(spec, size, vocab_divisible_by), offset, iv[2] - iv[1])


def _train_block(plan: ReshardPlan, rank: int, name: str, iv: Interval) -> Block:
    spec = plan.specs[name]
    return _shard_block(spec, *train_split(plan.train, spec, rank), plan.train_vocab_divisible_by, iv)


def _rollout_block(plan: ReshardPlan, rank: int, name: str, iv: Interval) -> Block:
    return _shard_block(
        plan.specs[name], plan.tp_g, plan.rollout_coords[rank][0], plan.rollout_vocab_divisible_by, iv
    )


def _table(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, TABLE_COLUMNS)


def _message(plan: ReshardPlan, rank: int, bucket: Bucket, offset: int) -> Message:
    """The table of one bucket: each transfer is one block of its shard, packed back to back."""
    send = bucket.src == rank
    names: dict[str, int] = {}
    rows, packed = [], 0
    for t in bucket.transfers:
        iv = (t.segment, t.start, t.stop)
        start, num_rows, cols, stride = (_train_block if send else _rollout_block)(plan, rank, t.param, iv)
        rows.append([names.setdefault(t.param, len(names)), start, num_rows, cols, stride, packed, cols])
        packed += num_rows * cols
    peer = bucket.dst if send else bucket.src
    return Message(peer, send, offset, packed, tuple(names), _table(rows))


def _local_copies(plan: ReshardPlan, rank: int) -> tuple[tuple[str, torch.Tensor], ...]:
    """One table per kept parameter: ``pack_copy`` writes a single output tensor, and joining the rollout
    shards into one flat tensor would tie their lifetimes together for whoever keeps one of them."""
    per_param: dict[str, list[list[int]]] = {}
    for name, iv in plan.local_copies.get(rank, []):
        src, num_rows, cols, src_stride = _train_block(plan, rank, name, iv)
        dst, *_, dst_stride = _rollout_block(plan, rank, name, iv)  # same rows x cols: the same units
        per_param.setdefault(name, []).append([0, src, num_rows, cols, src_stride, dst, dst_stride])
    return tuple((name, _table(rows)) for name, rows in per_param.items())


def execution_schedule(
    plan: ReshardPlan,
    rank: int,
    *,
    bucket_bytes: int = 64 << 20,
    max_inflight_bytes: int | None = None,
    bytes_per_element: int | None = None,
) -> ExecutionSchedule:
    """What ``rank`` does to execute ``plan`` with messages of at most ``bucket_bytes`` and at most
    ``max_inflight_bytes`` (default ``2 * bucket_bytes``) sent plus received per round, sizes counted at
    ``bytes_per_element`` (the rollout dtype; default the plan's). Pure, and memoised on the plan."""
    cap = 2 * bucket_bytes if max_inflight_bytes is None else max_inflight_bytes
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if cap <= 0:
        raise ValueError(f"max_inflight_bytes must be positive, got {cap}")
    bpe = bytes_per_element or plan.bytes_per_element

    def build() -> ExecutionSchedule:
        rounds, staging = [], 0
        for buckets in plan.rounds(bucket_bytes, cap, bpe):
            messages, offset = [], 0
            for bucket in buckets:
                if rank in (bucket.src, bucket.dst):
                    messages.append(_message(plan, rank, bucket, offset))
                    offset += messages[-1].numel
            if messages:  # rounds without this rank are skipped: only pairs synchronise, never all ranks
                rounds.append(tuple(messages))
            staging = max(staging, offset)
        return ExecutionSchedule(_local_copies(plan, rank), tuple(rounds), staging)

    return plan.cached(("execution", rank, bucket_bytes, cap, bpe), build)


def _sources(
    plan: ReshardPlan, rank: int, local: dict[str, torch.Tensor], schedule: ExecutionSchedule
) -> dict[str, torch.Tensor]:
    """``local`` checked against the plan: every key known to it, every key this rank sends or keeps present,
    shard shapes as planned; made contiguous (the kernels index raw memory)."""
    unknown = sorted(set(local) - set(plan.specs))
    if unknown:  # a naming mismatch: the plan and the engine disagree on canonical keys
        raise KeyError(f"rank {rank}: local parameters {unknown} are not in the reshard plan")
    read = {n for n, _ in schedule.local_copies}
    read.update(n for messages in schedule.rounds for m in messages if m.send for n in m.names)
    missing = sorted(read - set(local))
    if missing:
        raise KeyError(f"rank {rank}: the plan reads {missing} from this rank, which holds no such parameter")
    out = {}
    for name, tensor in local.items():
        spec = plan.specs[name]
        size, _ = _tp(spec, *train_split(plan.train, spec, rank))
        expected = shard_shape(spec, size, plan.train_vocab_divisible_by)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name}: training shard has shape {tuple(tensor.shape)}, plan expects {expected}"
            )
        out[name] = tensor.contiguous()
    if len({t.dtype for t in out.values()}) > 1:  # one kernel call packs several parameters
        raise ValueError(
            f"training shards must share one dtype, got {sorted({str(t.dtype) for t in out.values()})}"
        )
    return out


@torch.no_grad()
def execute_plan(
    plan: ReshardPlan,
    local: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    bucket_bytes: int = 64 << 20,
    max_inflight_bytes: int | None = None,
) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """This rank's rollout shards (megatron layout, ``tp_g``) built from its training shards ``local``.

    ``local`` maps canonical keys (:mod:`~mcore_rl.parallel.reshard.naming`) to this rank's training shards
    (``engine.weights.local_parameters``); parameters of other pipeline stages are absent. A key the plan does
    not know, or one it reads from this rank that ``local`` lacks, is an error naming the key and the rank. Messages hold at most ``bucket_bytes`` (unless one
    unit is larger) and this rank holds at most ``max_inflight_bytes`` (default ``2 * bucket_bytes``) of them
    at once, unless a single message is larger. A shard this rank keeps whole and unchanged is returned as the
    training tensor itself, not a copy: the shards are for reading (the rollout engines copy them on load).
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    any_local = next(iter(local.values()))
    dtype, device = dtype or any_local.dtype, device or any_local.device
    element_size = dtype.itemsize
    schedule = execution_schedule(
        plan,
        rank,
        bucket_bytes=bucket_bytes,
        max_inflight_bytes=max_inflight_bytes,
        bytes_per_element=element_size,
    )
    sources = _sources(plan, rank, local, schedule)
    shapes = {
        name: shard_shape(spec, plan.tp_g, plan.rollout_vocab_divisible_by)
        for name, spec in plan.specs.items()
    }
    # A training shard this rank keeps whole and unchanged (TP_g = TP, same dtype and device) is handed over
    # as is: a copy would only be copied again by the rollout engine's load.
    kept = {
        name
        for name, table in schedule.local_copies
        if _copies_whole(table, sources[name], shapes[name], dtype, device)
    }
    out = {
        name: sources[name] if name in kept else torch.zeros(shape, dtype=dtype, device=device)
        for name, shape in shapes.items()
    }
    for name, table in schedule.local_copies:
        if name not in kept:
            pack_copy([sources[name]], table, out[name])
    staging = torch.empty(schedule.staging_numel, dtype=dtype, device=device)
    for messages in schedule.rounds:
        _exchange(messages, staging, sources, out)
    stats = ReshardStats(
        time.perf_counter() - start,
        schedule.numel(send=True) * element_size,
        schedule.numel(send=False) * element_size,
        staging.numel() * element_size,
    )
    return out, stats


def _copies_whole(
    table: torch.Tensor,
    source: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether ``table`` copies all of ``source`` into an output of ``shape`` element for element: every block
    at the same offset and stride on both sides, covering every element."""
    if tuple(source.shape) != tuple(shape) or source.dtype != dtype or source.device != device:
        return False
    blocks = table.tolist()
    same_place = all(
        src_off == dst_off and src_stride == dst_stride
        for _, src_off, _, _, src_stride, dst_off, dst_stride in blocks
    )
    return same_place and sum(rows * cols for _, _, rows, cols, *_ in blocks) == source.numel()


def _exchange(
    messages: Sequence[Message],
    staging: torch.Tensor,
    sources: dict[str, torch.Tensor],
    out: dict[str, torch.Tensor],
) -> None:
    """One round: pack every outgoing message, exchange all of them at once, then drain the incoming ones."""
    ops = []
    for m in messages:
        buffer = staging[m.offset : m.offset + m.numel]
        if m.send:
            pack_copy([sources[n] for n in m.names], m.table, buffer)
        ops.append(dist.P2POp(dist.isend if m.send else dist.irecv, buffer, m.peer))
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    for m in messages:
        if not m.send:
            unpack_copy(staging[m.offset : m.offset + m.numel], m.table, [out[n] for n in m.names])
