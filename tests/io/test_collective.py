"""begin_collective / commit_collective on a gloo world of two ranks: whatever rank 0 meets, its peer learns it
in the broadcast instead of waiting there until the collective timeout."""

from __future__ import annotations

import os

import torch.distributed as dist

from mcore_rl.io.collective import begin_collective, commit_collective
from mcore_rl.io.output import OutputFolder


def _plan_that_fails(kind: str, out: str) -> OutputFolder:
    if kind == "bug":
        raise ValueError("a marker field that is not a number")
    return OutputFolder.plan(out, kind="test")  # "exists": out is a file, refused as an OutputError


def _begin_on_rank(kind: str, out: str) -> str:
    rank = dist.get_rank()
    try:
        begin_collective(lambda: _plan_that_fails(kind, out), rank)
    except BaseException as err:
        return f"{type(err).__name__}: {err}"
    return "began"


def test_every_rank_learns_rank_0_failing_to_begin_whatever_the_error(run_distributed, tmp_path) -> None:
    out = str(tmp_path / "out")
    with open(out, "w") as f:
        f.write("a user's file")
    rank0, rank1 = run_distributed(_begin_on_rank, "exists", out, timeout_s=60)
    assert rank0 == rank1 and rank0.startswith("OutputError") and "is not a folder" in rank0
    rank0, rank1 = run_distributed(_begin_on_rank, "bug", out, timeout_s=60)
    assert rank0 == "ValueError: a marker field that is not a number"  # rank 0 raises its own error
    assert (
        rank1
        == "OutputError: rank 0 could not begin the output: ValueError: a marker field that is not a number"
    )


def _write_on_rank(out: str) -> list[str]:
    rank = dist.get_rank()
    output, staging = begin_collective(lambda: OutputFolder.plan(out, kind="test"), rank)
    with open(os.path.join(staging, f"shard_{rank}"), "w") as f:
        f.write(str(rank))
    dist.barrier()
    commit_collective(output, rank, lambda: None)
    return sorted(os.listdir(out))


def test_every_rank_writes_into_one_staging_folder_published_by_rank_0(run_distributed, tmp_path) -> None:
    out = str(tmp_path / "out")
    listings = run_distributed(_write_on_rank, out, timeout_s=60)
    assert listings[0] == listings[1] and {"shard_0", "shard_1"} <= set(listings[0])
