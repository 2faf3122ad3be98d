"""A finite loss whose gradient is not (a backward overflow) never reaches the weights: megatron's fp32 and
bf16 optimizers have no grad scaler to find it, and Adam stepped NaN into every weight. The check is
collective: a gradient that overflows on one rank skips, or stops, the update on every rank."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, NonFiniteLossError, TrainEngine
from mcore_rl.engine.workers.losses import PolicyLossSettings, PolicyMicroBatch, policy_loss
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import TrainBatch
from tests.models import tiny_arch


def _backward(engine: TrainEngine, vocab: int) -> torch.Tensor:
    """A real policy-loss backward on fixed rows; returns the summed loss terms (finite)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 16), generator=g)
    mask = torch.zeros(2, 16)
    mask[:, 5:12] = 1.0
    old = -torch.rand(2, 16, generator=g) * mask
    batch = TrainBatch(tokens, mask, old, torch.randn(2, 16, generator=g) * mask, torch.zeros(2, 16))
    loss = policy_loss(PolicyLossSettings(vocab_size=vocab, temperature=1.0), mask.sum(), torch.tensor(2.0))
    micro: list[MicroBatch] = [PolicyMicroBatch(tokens, torch.arange(16).expand_as(tokens), train=batch)]
    engine.zero_grad()
    out = engine.forward_backward(micro, loss)
    return torch.stack([m.summable() for m in out]).sum(0)


def _overflow_on_rank_one(on_nonfinite: str) -> dict:
    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-2))
        params = [p for m in engine.models for p in m.parameters()]
        # a first real update, as PolicyUpdate runs it: Adam's moments are no longer zero, so any step taken
        # on the overflowed gradient below (even a zeroed one) would move the weights
        assert engine.finite_or_skip(_backward(engine, arch.vocab_size), on_nonfinite, "loss")
        engine.step()
        before = [p.detach().clone() for p in params]
        local = _backward(engine, arch.vocab_size)
        if ctx.rank == 1:
            params[0].main_grad.view(-1)[0] = float("inf")
        try:
            applied, error = engine.finite_or_skip(local, on_nonfinite, "loss"), None
        except NonFiniteLossError as err:
            applied, error = None, str(err)
        if applied:
            engine.step()
        grads_zero = all(bool((p.main_grad == 0).all()) for p in params)
        unchanged = all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        assert torch.isfinite(local).all()
        # the next step's gradients are finite again: it is applied and moves the weights
        local = _backward(engine, arch.vocab_size)
        next_applied = engine.finite_or_skip(local, on_nonfinite, "loss")
        if next_applied:
            engine.step()
        moved = not all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        return {
            "applied": applied,
            "error": error,
            "grads_zero": grads_zero,
            "next": next_applied,
            "same": unchanged,
            "moved": moved,
        }


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_an_overflowed_gradient_on_one_rank_skips_or_stops_every_rank(
    run_distributed, on_nonfinite: str
) -> None:
    results = run_distributed(_overflow_on_rank_one, on_nonfinite, world_size=2)
    for rank, result in enumerate(results):
        assert result["grads_zero"] and result["same"] and result["next"] and result["moved"], (rank, result)
        if on_nonfinite == "skip":
            assert result["applied"] is False and result["error"] is None
        else:
            assert result["applied"] is None
    if on_nonfinite == "stop":
        assert (
            results[1]["error"]
            == "rank 1: a NaN/inf gradient (the loss was finite); the update was not applied"
        )
        assert (
            results[0]["error"]
            == "rank 0: a NaN/inf loss or gradient on another rank; the update was not applied"
        )
