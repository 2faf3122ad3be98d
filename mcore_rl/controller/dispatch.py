"""Explicit dispatch between the driver and a worker group: pure rank arithmetic, tested without Ray.

The driver holds whole batches; a worker group holds ``world_size`` ranks laid out as (tp, pp, dp) for
training and as rollout replicas (tp_g ranks each) for generation. Data moves in whole shards:

    split:    batch [N, ...] --split_record(num_shards)--> shard 0 | shard 1 | ...   (contiguous rows)
    scatter:  shard d goes to every rank whose dp_rank (or rollout replica) is d     (TP/PP peers share it)
    collect:  from the one owner of each shard: last pipeline stage, tensor and context rank 0  (data_owners)
    concat:   owner results in shard order --concat_records--> batch [N, ...]

Records are dataclasses whose tensor (and list) fields share a leading row dimension; other fields (ints,
floats, strings) are copied into every shard unchanged and must agree when concatenated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from mcore_rl.types import RankInfo

R = TypeVar("R")


def row_slices(num_rows: int, num_shards: int, what: str = "rows") -> list[slice]:
    """``num_shards`` contiguous equal slices of ``num_rows``; ValueError naming ``what`` unless divisible."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_rows % num_shards:
        raise ValueError(f"{what}: {num_rows} rows do not split evenly over {num_shards} ranks")
    size = num_rows // num_shards
    return [slice(i * size, (i + 1) * size) for i in range(num_shards)]


def _row_fields(record: Any) -> tuple[dict[str, Any], int]:
    """The fields of ``record`` that carry rows (tensors with a dim 0, lists), and their common row count."""
    rows = {
        f.name: getattr(record, f.name)
        for f in dataclasses.fields(record)
        if isinstance(getattr(record, f.name), torch.Tensor | list)
        and not (isinstance(getattr(record, f.name), torch.Tensor) and getattr(record, f.name).dim() == 0)
    }
    counts = {name: len(value) for name, value in rows.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{type(record).__name__}: row fields disagree on the row count: {counts}")
    return rows, next(iter(counts.values()), 0)


def split_record(record: R, num_shards: int) -> list[R]:
    """Contiguous row shards of a record dataclass (tensor views, list slices); other fields copied."""
    rows, num_rows = _row_fields(record)
    slices = row_slices(num_rows, num_shards, type(record).__name__)
    return [dataclasses.replace(record, **{k: v[s] for k, v in rows.items()}) for s in slices]  # type: ignore[type-var]


def concat_records(records: Sequence[R]) -> R:
    """Inverse of :func:`split_record`: row fields concatenated in order; the others must agree."""
    if not records:
        raise ValueError("concat_records needs at least one record")
    first = records[0]
    rows, _ = _row_fields(first)
    merged: dict[str, Any] = {}
    for name, value in rows.items():
        parts = [getattr(r, name) for r in records]
        merged[name] = torch.cat(parts) if isinstance(value, torch.Tensor) else [x for p in parts for x in p]
    for f in dataclasses.fields(first):  # type: ignore[arg-type]
        if f.name not in rows and any(getattr(r, f.name) != getattr(first, f.name) for r in records):
            raise ValueError(f"{type(first).__name__}.{f.name} differs between shards; cannot concatenate")
    return dataclasses.replace(first, **merged)  # type: ignore[type-var]


def data_owners(infos: Sequence[RankInfo]) -> list[int]:
    """Index in ``infos`` of the owner of each training DP shard, in dp order: last stage, TP and CP rank 0."""
    owners = [
        (i.dp_rank, n) for n, i in enumerate(infos) if i.is_last_stage and i.tp_rank == 0 and i.cp_rank == 0
    ]
    return _dense(owners, "training dp shard")


def rollout_owners(infos: Sequence[RankInfo]) -> list[int]:
    """Index in ``infos`` of the owner of each rollout replica's samples, in replica order."""
    owners = [(i.rollout_replica, n) for n, i in enumerate(infos) if i.rollout_tp_rank == 0]
    return _dense(owners, "rollout replica")


def num_dp_shards(infos: Sequence[RankInfo]) -> int:
    return len(data_owners(infos))


def num_rollout_shards(infos: Sequence[RankInfo]) -> int:
    return len(rollout_owners(infos))


def _dense(owners: list[tuple[int, int]], what: str) -> list[int]:
    """(shard, rank) pairs -> each shard's rank in shard order; two ranks claiming one shard (both would
    compute it, their results merged into one) or a shard without a rank is refused."""
    shards = sorted(shard for shard, _ in owners)
    if shards != list(range(len(owners))):
        raise ValueError(f"every {what} needs exactly one owner rank, got owners of {shards}")
    return [rank for _, rank in sorted(owners)]


def shard_of_rank(infos: Sequence[RankInfo], by: str) -> list[int]:
    """For each rank, which shard it consumes: ``by='dp'`` (training) or ``by='rollout'`` (generation)."""
    if by == "dp":
        return [i.dp_rank for i in infos]
    if by == "rollout":
        return [i.rollout_replica for i in infos]
    raise ValueError(f"by must be 'dp' or 'rollout', got {by!r}")
