"""Which of megatron's gradient reductions the host reducer takes over (mcore_rl/compat/grad_reduce.py); the sums
themselves: tests/parallel/test_host_reduce.py, and DP2 parity through them: tests/engine/test_layout_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mcore_rl.compat.grad_reduce import REDUCER_ATTR, _takes_over, reduce_grads_on_host


def _bucket_group(group: object | None, numel: int, **config: object) -> SimpleNamespace:
    settings = {"overlap_grad_reduce": False, "use_distributed_optimizer": False, **config}
    bucket = SimpleNamespace(grad_data=torch.zeros(numel))
    bucket_group = SimpleNamespace(ddp_config=SimpleNamespace(**settings), buckets=[bucket])
    if group is not None:  # megatron names no data-parallel group under the distributed optimizer
        bucket_group.data_parallel_group = group
    return bucket_group


@pytest.mark.parametrize(
    ("config", "force_all_reduce", "taken"),
    [
        ({}, False, True),
        ({"overlap_grad_reduce": True}, False, False),  # asynchronous, overlapped with the backward
        ({"use_distributed_optimizer": True}, False, False),  # a reduce-scatter
        ({"use_distributed_optimizer": True}, True, True),  # an all-reduce forced on it
        ({"num_distributed_optimizer_instances": 2}, False, False),
    ],
)
def test_only_the_synchronous_all_reduce_is_taken_over(config, force_all_reduce, taken):
    bucket_group = _bucket_group("dp", 8, **config)
    setattr(bucket_group, REDUCER_ATTR, object())
    assert _takes_over(bucket_group, force_all_reduce) is taken
    delattr(bucket_group, REDUCER_ATTR)
    assert not _takes_over(bucket_group, force_all_reduce)  # no reducer: megatron's own


def test_one_reducer_per_group_sized_for_its_largest_bucket():
    dp, other = object(), object()
    chunks = [
        SimpleNamespace(
            bucket_groups=[_bucket_group(dp, 10), _bucket_group(dp, 30), _bucket_group(None, 99)]
        ),
        SimpleNamespace(bucket_groups=[_bucket_group(other, 5)]),
    ]
    opened = []

    def open_reducer(group: object, largest_bytes: int) -> object | None:
        opened.append((group, largest_bytes))
        return None if group is other else f"reducer {len(opened)}"

    assert reduce_grads_on_host(chunks, open_reducer) == 2
    assert opened == [(dp, 30 * 4), (other, 5 * 4)]  # collective per group, in the chunks' order
    given = [getattr(g, REDUCER_ATTR, None) for c in chunks for g in c.bucket_groups]
    assert given == ["reducer 1", "reducer 1", None, None]
