"""The critic at TP2xPP2 and at TP2 with sequence parallelism (gloo, fp32) equals the critic at TP1: its values, its clipped value loss and grad
norm, and its values after one optimizer step, within 1e-5. Same weights (a TP1 full state loaded into
both), same rows; at TP1 the 4 ranks are data-parallel and each takes a quarter of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.engine.workers.critic import Critic, CriticSpec, ValueBatch
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch

ROWS, SEQ = 8, 12


def _batch(vocab: int) -> ValueBatch:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, vocab, (ROWS, SEQ), generator=generator)
    mask = torch.zeros(ROWS, SEQ)
    for row in range(ROWS):  # responses of different lengths after a 4-token prompt
        mask[row, 3 : 3 + 2 + row % 6] = 1.0
    old = torch.randn(ROWS, SEQ, generator=generator) * mask
    returns = (old + torch.randn(ROWS, SEQ, generator=generator)) * mask
    return ValueBatch(tokens, mask, old, returns)


def _initial_state() -> dict[str, torch.Tensor]:
    """The shared start: a TP1 random init of the critic, as a full state."""
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        return gather_full_state(Critic(ctx, _spec()).engine.models, _arch(), ctx)


def _arch() -> ModelArch:
    return tiny_arch("llama")


def _spec() -> CriticSpec:
    return CriticSpec(
        _arch(), OptimConfig(lr=1e-2, weight_decay=0.0), total_optimizer_steps=1, cliprange_value=0.2
    )


def _critic_in_layout(parallel: dict, full: dict[str, torch.Tensor]) -> dict:
    arch, spec = _arch(), _spec()
    batch = _batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        critic = Critic(ctx, spec)
        critic.engine.load_full_state(full)
        before = critic.values(batch.tokens, micro_batch_size=4)
        rows = slice(ctx.dp_rank * ROWS // ctx.dp_size, (ctx.dp_rank + 1) * ROWS // ctx.dp_size)
        shard = ValueBatch(
            *(getattr(batch, f)[rows] for f in ("tokens", "response_mask", "old_values", "returns"))
        )
        stats = critic.update(
            shard, num_mini_batches=1, ppo_epochs=1, micro_batch_size=min(2, shard.tokens.shape[0])
        )
        after = critic.values(batch.tokens, micro_batch_size=4)
        dist.barrier()
        return {"before": before, "after": after, "stats": stats}


LAYOUTS = {
    "tp2-pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    # the value head gathers SP's sequence shards: its backward summing TP identical gradients doubled the body's
    "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
}


@pytest.fixture(scope="module")
def tp1(run_distributed) -> tuple[dict, dict]:
    full = run_distributed(_initial_state, world_size=4)[0]
    return full, run_distributed(_critic_in_layout, {}, full, world_size=4)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_layouts_equal_tp1(run_distributed, tp1, layout: str) -> None:
    full, tp1 = tp1
    tp2pp2 = run_distributed(_critic_in_layout, LAYOUTS[layout], full, world_size=4)
    owners = [r for r in tp2pp2 if r["before"] is not None]
    model_parallel = LAYOUTS[layout]["tensor_model_parallel_size"] * LAYOUTS[layout].get(
        "pipeline_model_parallel_size", 1
    )
    assert len(owners) == 4 // model_parallel  # per data-parallel rank, the last stage's TP rank 0
    got = owners[0]
    assert tp1["before"].shape == (ROWS, SEQ)
    # 1e-5 relative to the values' scale (up to ~2): TP/PP-split GEMMs round differently per CPU kernel (AVX2
    # machines measured 1.08e-5 on a value of ~1.8 after the step)
    for when in ("before", "after"):
        scale = max(1.0, float(tp1[when].abs().max()))
        assert (got[when] - tp1[when]).abs().max() <= 1e-5 * scale, when
    assert (tp1["after"] - tp1["before"]).abs().max() > 1e-3  # the step moved the values
    for key in ("vf_loss", "vf_clip_frac", "vpred_mean", "grad_norm"):
        assert abs(getattr(got["stats"], key) - getattr(tp1["stats"], key)) <= 1e-5, key
    assert 0.0 < tp1["stats"].vf_clip_frac < 1.0  # the clip is active on some tokens, not all


def _critic_with_nan_returns(on_nonfinite: str) -> dict:
    from dataclasses import replace

    from mcore_rl.engine.train_engine import NonFiniteLossError

    arch, spec = _arch(), replace(_spec(), on_nonfinite=on_nonfinite)
    batch = _batch(arch.vocab_size)
    nan = ValueBatch(batch.tokens, batch.response_mask, batch.old_values, batch.returns * float("nan"))
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        critic = Critic(ctx, spec)
        before = critic.values(batch.tokens, micro_batch_size=4)
        try:
            stats, error = critic.update(nan, num_mini_batches=2, ppo_epochs=1, micro_batch_size=2), None
        except NonFiniteLossError as err:
            stats, error = None, str(err)
        after = critic.values(batch.tokens, micro_batch_size=4)
        return {"stats": stats, "error": error, "same": torch.equal(before, after)}


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_a_nan_critic_loss_follows_on_nonfinite_loss(run_distributed, on_nonfinite: str) -> None:
    result = run_distributed(_critic_with_nan_returns, on_nonfinite, world_size=1)[0]
    assert result["same"]  # no update reached the weights
    if on_nonfinite == "skip":  # both mini-batches skipped and counted; the run goes on
        assert result["error"] is None and result["stats"].num_skipped == 2
    else:
        assert result["stats"] is None and "NaN/inf critic loss" in result["error"]
