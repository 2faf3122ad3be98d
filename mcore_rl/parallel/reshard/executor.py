"""Run a :class:`ReshardPlan` over torch.distributed point-to-point (gloo on CPU, NCCL on GPU).

Each rank allocates only its own rollout shards, copies what it keeps from its training shards, and then
exchanges one flat buffer per (sender, receiver) pair and bucket round. Buffers are filled by copying views
straight into place (no ``torch.cat``), so the extra memory in flight is one bucket per peer. Every pair
exchanges at most one message per round, so batched isend/irecv cannot mismatch messages.

Output tensors use megatron's shard layout for the rollout TP degree (``tp_shard`` of the full tensor with
``tp_g``); ``to_rollout_layout`` in the rollout engine turns them into its own names and fused layouts.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.parallel.reshard.plan import Interval, ParamSpec, ReshardPlan, Transfer, local_units, shard_view
from mcore_rl.parallel.sharding import ShardKind


@dataclass(frozen=True)
class ReshardStats:
    seconds: float
    bytes_sent: int
    bytes_received: int
    peak_buffer_bytes: int
    """Largest total of send + receive buffers alive at once on this rank."""


def rollout_shard_shape(spec: ParamSpec, tp_g: int, vocab_divisible_by: int = 128) -> tuple[int, ...]:
    if spec.kind is ShardKind.REPLICATED:
        return spec.shape
    shape = list(spec.shape)
    if spec.kind is ShardKind.VOCAB:
        shape[0] = padded_vocab_size(spec.shape[0], tp_g, vocab_divisible_by) // tp_g
    else:
        shape[spec.split_dim] //= tp_g
    return tuple(shape)


def _tp(spec: ParamSpec, tp: int, coord: int) -> tuple[int, int]:
    """(tp size, coordinate) as seen by ``local_units``: replicated params are one whole shard."""
    return (1, 0) if spec.kind is ShardKind.REPLICATED else (tp, coord)


def _train_view(
    plan: ReshardPlan, local: dict[str, torch.Tensor], rank: int, name: str, iv: Interval
) -> torch.Tensor:
    spec = plan.specs[name]
    size, coord = _tp(spec, plan.train.tp, plan.train.coords(rank).tp)
    offset = local_units(spec, size, coord, iv, plan.train_vocab_divisible_by)
    return shard_view(spec, local[name], offset, iv[2] - iv[1])


def _rollout_view(
    plan: ReshardPlan, out: dict[str, torch.Tensor], rank: int, name: str, iv: Interval
) -> torch.Tensor:
    spec = plan.specs[name]
    size, coord = _tp(spec, plan.tp_g, plan.rollout_coords[rank][0])
    offset = local_units(spec, size, coord, iv, plan.rollout_vocab_divisible_by)
    return shard_view(spec, out[name], offset, iv[2] - iv[1])


def _rounds(plan: ReshardPlan, rank: int, bucket_bytes: int) -> list[list[list[Transfer]]]:
    """Per round, the buckets this rank sends or receives (at most one per peer and direction)."""
    per_pair: dict[tuple[int, int], list[list[Transfer]]] = defaultdict(list)
    for bucket in plan.buckets(bucket_bytes):
        src, dst = bucket[0].src, bucket[0].dst
        if rank in (src, dst):
            per_pair[(src, dst)].append(bucket)
    depth = max((len(b) for b in per_pair.values()), default=0)
    return [[b[i] for b in per_pair.values() if i < len(b)] for i in range(depth)]


@torch.no_grad()
def execute_plan(
    plan: ReshardPlan,
    local: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    bucket_bytes: int = 64 << 20,
) -> tuple[dict[str, torch.Tensor], ReshardStats]:
    """This rank's rollout shards (megatron layout, ``tp_g``) built from its training shards ``local``.

    ``local`` maps full-state names to this rank's training shards (``engine.weights.local_parameters``);
    parameters of other pipeline stages are simply absent.
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    any_local = next(iter(local.values()))
    dtype, device = dtype or any_local.dtype, device or any_local.device
    out = {
        name: torch.zeros(
            rollout_shard_shape(spec, plan.tp_g, plan.rollout_vocab_divisible_by), dtype=dtype, device=device
        )
        for name, spec in plan.specs.items()
    }
    for name, iv in plan.local_copies.get(rank, []):
        _rollout_view(plan, out, rank, name, iv).copy_(_train_view(plan, local, rank, name, iv))
    sent = received = peak = 0
    for buckets in _rounds(plan, rank, bucket_bytes):
        ops, unpack, alive = [], [], 0
        for bucket in buckets:
            numel = sum(t.num_bytes for t in bucket) // plan.bytes_per_element
            buffer = torch.empty(numel, dtype=dtype, device=device)
            alive += buffer.numel() * buffer.element_size()
            if bucket[0].src == rank:
                _fill(plan, local, rank, bucket, buffer)
                ops.append(dist.P2POp(dist.isend, buffer, bucket[0].dst))
                sent += buffer.numel() * buffer.element_size()
            else:
                ops.append(dist.P2POp(dist.irecv, buffer, bucket[0].src))
                unpack.append((bucket, buffer))
                received += buffer.numel() * buffer.element_size()
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for bucket, buffer in unpack:
            _drain(plan, out, rank, bucket, buffer)
        peak = max(peak, alive)
    return out, ReshardStats(time.perf_counter() - start, sent, received, peak)


def _fill(
    plan: ReshardPlan, local: dict[str, torch.Tensor], rank: int, bucket: list[Transfer], buffer: torch.Tensor
) -> None:
    offset = 0
    for t in bucket:
        view = _train_view(plan, local, rank, t.param, (t.segment, t.start, t.stop))
        buffer[offset : offset + view.numel()].view_as(view).copy_(view)
        offset += view.numel()


def _drain(
    plan: ReshardPlan, out: dict[str, torch.Tensor], rank: int, bucket: list[Transfer], buffer: torch.Tensor
) -> None:
    offset = 0
    for t in bucket:
        view = _rollout_view(plan, out, rank, t.param, (t.segment, t.start, t.stop))
        view.copy_(buffer[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()
