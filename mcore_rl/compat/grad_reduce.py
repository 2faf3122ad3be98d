"""megatron's data-parallel gradient all-reduce through another reducer, on CPU ranks that share a host.

megatron's DDP sums each bucket of its grad buffer with ``torch.distributed.all_reduce`` over the bucket
group's data-parallel group (``_ParamAndGradBucketGroup.start_grad_sync``); on CPU that is gloo over TCP
loopback. :func:`reduce_grads_on_host` hands each dense bucket group of DDP-wrapped chunks a reducer (in our
runs :class:`mcore_rl.parallel.host_reduce.HostReduce`, given as a factory so this module stays a leaf), and
the patched ``start_grad_sync`` runs megatron's own steps (grad checks, scaling) then sums every bucket
through it. Only the synchronous all-reduce is taken over: with ``overlap_grad_reduce``, the distributed
optimizer's reduce-scatter or several optimizer instances, megatron's own code runs unchanged, as it does
for a bucket group without a reducer (expert-parallel buckets, one rank, GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REDUCER_ATTR = "_mcore_rl_host_reduce"
"""The attribute of a bucket group holding its reducer (absent: megatron's all-reduce)."""


def _takes_over(bucket_group: Any, force_all_reduce: bool) -> bool:
    config = bucket_group.ddp_config
    return (
        getattr(bucket_group, REDUCER_ATTR, None) is not None
        and not config.overlap_grad_reduce
        and (not config.use_distributed_optimizer or force_all_reduce)
        and getattr(config, "num_distributed_optimizer_instances", 1) == 1
    )


def patch_bucket_group() -> None:
    """Route the synchronous all-reduce of bucket groups that hold a reducer through it (idempotent)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    original = _ParamAndGradBucketGroup.start_grad_sync
    if getattr(original, "_mcore_rl_patched", False):
        return

    def start_grad_sync(self: Any, force_all_reduce: bool | None = False) -> None:
        if not _takes_over(self, bool(force_all_reduce)):
            original(self, force_all_reduce=force_all_reduce)
            return
        if self.grad_reduce_handle is not None:
            raise RuntimeError("a gradient reduction is already in flight for this bucket group")
        config = self.ddp_config
        nan_check = getattr(config, "check_for_nan_in_grad", False)
        large_check = getattr(config, "check_for_large_grads", False)
        if nan_check or large_check:
            self.check_grads(check_for_nan_or_inf=nan_check, check_for_large=large_check)
        reducer = getattr(self, REDUCER_ATTR)
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            reducer.all_reduce_(bucket.grad_data, average=bool(config.average_in_collective))

    start_grad_sync._mcore_rl_patched = True  # type: ignore[attr-defined]
    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync


def reduce_grads_on_host(chunks: list[Any], open_reducer: Callable[[Any, int], Any | None]) -> int:
    """Give the dense bucket groups of DDP-wrapped ``chunks`` a reducer per data-parallel group:
    ``open_reducer(group, slot_bytes)`` is collective over the group's ranks (every rank builds the same
    chunks, so they call it in the same order) and may return None (megatron's all-reduce stays). Needs
    :func:`patch_bucket_group` applied. Returns the number of bucket groups given one."""
    bucket_groups = [  # all-reducing groups only: with the distributed optimizer megatron names no such group
        bucket_group
        for chunk in chunks
        for bucket_group in getattr(chunk, "bucket_groups", [])
        if getattr(bucket_group, "data_parallel_group", None) is not None
    ]
    largest: dict[int, int] = {}
    for bucket_group in bucket_groups:
        key = id(bucket_group.data_parallel_group)
        for bucket in bucket_group.buckets:
            largest[key] = max(
                largest.get(key, 0), bucket.grad_data.numel() * bucket.grad_data.element_size()
            )
    reducers: dict[int, Any] = {}
    given = 0
    for bucket_group in bucket_groups:
        group = bucket_group.data_parallel_group
        if id(group) not in reducers:
            reducers[id(group)] = open_reducer(group, largest.get(id(group), 0))
        if reducers[id(group)] is not None:
            setattr(bucket_group, REDUCER_ATTR, reducers[id(group)])
            given += 1
    return given
