"""TP=2 (two gloo ranks, vocab split in halves, megatron-style padding) gives the TP=1 results."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mcore_rl.ops import linear_logprob_entropy, vocab_parallel_logprob_entropy

N, VOCAB, PADDED, HIDDEN = 37, 1001, 1004, 16  # megatron pads the vocab to a multiple of TP (here 4)


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(N, PADDED, generator=gen) * 4
    logits[:, VOCAB:] = 1e4  # padding must never count
    return {
        "logits": logits.to(dtype),
        "hidden": torch.randn(N, HIDDEN, generator=gen).to(dtype),
        "weight": (torch.randn(PADDED, HIDDEN, generator=gen) / 2).to(dtype),
        "targets": torch.randint(0, VOCAB, (N,), generator=gen),
        "g1": torch.randn(N, generator=gen),
        "g2": torch.randn(N, generator=gen),
    }


def _logits_op(dtype: torch.dtype, tp: int, rank: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    d = _inputs(dtype)
    width = PADDED // tp
    shard = d["logits"][:, rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(
        shard,
        d["targets"],
        vocab_start=rank * width,
        vocab_size=VOCAB,
        temperature=0.7,
        tp_group=group,
        chunk_size=10,
    )
    (lp * d["g1"] + ent * d["g2"]).sum().backward()
    return [lp.detach(), ent.detach(), shard.grad]


def _linear_op(dtype: torch.dtype, tp: int, rank: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    d = _inputs(dtype)
    width = PADDED // tp
    hidden = d["hidden"].clone().requires_grad_()
    weight = d["weight"][rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, ent = linear_logprob_entropy(
        hidden,
        weight,
        d["targets"],
        vocab_start=rank * width,
        vocab_size=VOCAB,
        tp_group=group,
        vocab_chunk_size=128,
    )
    (lp * d["g1"] + ent * d["g2"]).sum().backward()
    if group is not None:  # megatron all-reduces the input gradient of the vocab-parallel output layer
        dist.all_reduce(hidden.grad, group=group)
    return [lp.detach(), ent.detach(), hidden.grad, weight.grad]


def _on_rank(kind: str, dtype: torch.dtype, force_reference: bool) -> list[torch.Tensor]:
    fn = _logits_op if kind == "logits" else _linear_op
    # The worker processes are shared with other tests: set the override only for this call.
    saved = os.environ.pop("MCORE_RL_FORCE_REFERENCE", None)
    os.environ["MCORE_RL_FORCE_REFERENCE"] = "1" if force_reference else "0"
    try:
        return fn(dtype, 2, dist.get_rank(), dist.group.WORLD)
    finally:
        os.environ.pop("MCORE_RL_FORCE_REFERENCE")
        if saved is not None:
            os.environ["MCORE_RL_FORCE_REFERENCE"] = saved


def _check(kind: str, dtype: torch.dtype, impl: str, run_distributed) -> None:
    fn = _logits_op if kind == "logits" else _linear_op
    single = fn(dtype, 1, 0, None)
    ranks = run_distributed(_on_rank, kind, dtype, impl == "reference")
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for per_rank in ranks:  # every rank gets the full-vocab values
        torch.testing.assert_close(per_rank[0], single[0], rtol=0, atol=atol)
        torch.testing.assert_close(per_rank[1], single[1], rtol=0, atol=atol)
    grad_dim = 1 if kind == "logits" else 0
    sharded_grad = torch.cat([r[-1] for r in ranks], dim=grad_dim)
    torch.testing.assert_close(sharded_grad, single[-1], rtol=0, atol=atol)
    if kind == "linear":
        torch.testing.assert_close(ranks[0][2], single[2], rtol=0, atol=atol)


def test_tp2_equals_tp1_fp32(impl: str, run_distributed) -> None:
    _check("logits", torch.float32, impl, run_distributed)


def test_tp2_equals_tp1_bf16(run_distributed) -> None:
    _check("logits", torch.bfloat16, "native", run_distributed)


def test_tp2_equals_tp1_linear(impl: str, run_distributed) -> None:
    _check("linear", torch.float32, impl, run_distributed)


def _one_row(tp: int, rank: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Both ops on a single row (a one-token response): its stats column is contiguous without a copy."""
    d = _inputs(torch.float32)
    width = PADDED // tp
    rows, weight = slice(0, 1), d["weight"][rank * width : (rank + 1) * width]
    common = {"vocab_start": rank * width, "vocab_size": VOCAB, "temperature": 0.7, "tp_group": group}
    lp, ent = vocab_parallel_logprob_entropy(
        d["logits"][rows, rank * width : (rank + 1) * width], d["targets"][rows], **common
    )
    lin_lp, lin_ent = linear_logprob_entropy(d["hidden"][rows], weight, d["targets"][rows], **common)
    return [lp, ent, lin_lp, lin_ent]


def _one_row_on_rank() -> list[torch.Tensor]:
    return _one_row(2, dist.get_rank(), dist.group.WORLD)


def test_tp2_one_row(run_distributed) -> None:
    single = _one_row(1, 0, None)
    for per_rank in run_distributed(_one_row_on_rank):
        for got, want in zip(per_rank, single, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
