"""Layout parity of mixture-of-experts training: the same weights and global batch give the same loss, router
losses, gradient norm and update at TP1, EP2, TP2 x EP2 (SP, expert TP 2) and PP2 x EP2.

With the router losses off, the TP1 engine equals a plain single-process PyTorch step (the dense parity test's
reference); with the load-balancing loss and the z-loss on, every layout equals the TP1 engine, since each
micro-batch's router losses depend on its own tokens only and ``engine/moe.py`` weighs them by tokens.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mcore_rl.engine.model import ModelOptions, build_model_chunks
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.engine.test_layout_parity import (
    OPTIM,
    _ce_loss,
    _check,
    _dp_slice_batches,
    _global_batch,
    _layout_run,
    row_batches,
)
from tests.engine.test_layout_parity import _sum_over_dp as sum_over_dp
from tests.models import tiny_arch

ROUTER_LOSSES = ModelOptions(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
EP2 = {"expert_model_parallel_size": 2}


def _train(family: str, parallel: dict, full: dict, options: ModelOptions) -> dict:
    arch = tiny_arch(family)
    tokens, labels = _global_batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, options, OPTIM)
        engine.load_full_state(full)
        batches = _dp_slice_batches(ctx, tokens, labels, arch.vocab_size)
        step, metrics = engine.train_step(batches, _ce_loss)
        router = engine.router_losses
        after = engine.forward_backward(batches, _ce_loss, forward_only=True)
        after_full = gather_full_state(engine.models, arch, ctx)
        return {
            "loss": sum_over_dp(ctx, metrics) if ctx.is_last_stage else None,
            "loss_after": sum_over_dp(ctx, after) if ctx.is_last_stage else None,
            "grad_norm": step.grad_norm,
            "load_balancing": router.load_balancing,
            "z_loss": router.z_loss,
            "expert_after": after_full["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"],
            "router_after": after_full["decoder.layers.0.mlp.router.weight"],
        }


def _router_loss_runs(family: str, parallel: dict, options: ModelOptions = ROUTER_LOSSES) -> dict:
    arch = tiny_arch(family)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    return {"tp1": _train(family, {}, full, options), "layout": _train(family, parallel, full, options)}


def _compare(results: list[dict]) -> dict[str, float]:
    base = next(r["tp1"] for r in results if r["tp1"]["loss"] is not None)
    diffs: dict[str, float] = {}
    for result in results:
        ours = result["layout"]
        for name in ("loss", "loss_after", "grad_norm", "load_balancing", "z_loss"):
            if ours[name] is not None:
                diffs[name] = max(diffs.get(name, 0.0), abs(ours[name] - base[name]))
        for name in ("expert_after", "router_after"):
            diffs[name] = max(diffs.get(name, 0.0), float((ours[name] - base[name]).abs().max()))
    assert base["load_balancing"] > 0.5 and base["z_loss"] > 0  # both router losses were on and measured
    for name, diff in diffs.items():
        assert diff <= 1e-5, f"{name} differs by {diff:.3g}: {diffs}"
    return diffs


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.sweep)])
def test_moe_router_off_equals_plain_pytorch_at_ep2(run_distributed, family):
    _check(run_distributed(_layout_run, family, EP2), atol=1e-5)


@pytest.mark.parametrize(
    "parallel",
    [
        EP2,
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1, **EP2},
    ],
    ids=["ep2", "tp2-sp-ep2-etp1"],
)
def test_moe_router_losses_layout_parity_world2(run_distributed, parallel):
    diffs = _compare(run_distributed(_router_loss_runs, "qwen3_moe", parallel))
    print(f"\n{parallel} vs TP1 with router losses: {diffs}")


@pytest.mark.sweep  # CI time: the world-4 hybrid test trains TP2xEP2 in the default tier
@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, **EP2},
        {"pipeline_model_parallel_size": 2, **EP2},
    ],
    ids=["tp2-sp-ep2", "pp2-ep2"],
)
def test_moe_router_losses_layout_parity_world4(run_distributed, parallel):
    diffs = _compare(run_distributed(_router_loss_runs, "qwen3_moe", parallel, world_size=4))
    print(f"\n{parallel} vs TP1 with router losses: {diffs}")


def _router_updates() -> float:
    arch = tiny_arch("qwen3_moe")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    without, with_losses = (_train("qwen3_moe", {}, full, o) for o in (ModelOptions(), ROUTER_LOSSES))
    dist.barrier()
    return float((with_losses["router_after"] - without["router_after"]).abs().max())


@pytest.mark.sweep
def test_router_loss_terms_reach_the_update(run_distributed):
    """The router losses move the router's update by far more than the parity tolerance, so the parity
    above would catch a layout that dropped or mis-scaled them."""
    assert run_distributed(_router_updates)[0] > 1e-4


def _uneven_micro_batches() -> dict:
    """EP2 with 1 micro-batch on rank 0 and 3 on rank 1 (as token budgets give): fillers keep the experts'
    exchange in step, and the update equals the TP1 engine's on the same 4 sequences."""
    arch = tiny_arch("qwen3_moe")
    tokens, labels = _global_batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    out = {}
    for name, parallel in (("tp1", {}), ("ep2", EP2)):
        with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
            engine = TrainEngine.build(arch, ctx, ModelOptions(), OPTIM)
            engine.load_full_state(full)
            rows = [0] if dist.get_rank() == 0 else [1, 2, 3]
            if name == "tp1":  # every rank runs all four as its own batch: a DP2 of identical halves
                rows = [0, 1, 2, 3]
            batches = row_batches(tokens, labels, arch.vocab_size, rows)
            step, metrics = engine.train_step(batches, _ce_loss)
            out[name] = {"records": len(metrics), "grad_norm": step.grad_norm}
    return out


def test_uneven_micro_batches_are_balanced_for_expert_parallelism(run_distributed):
    results = run_distributed(_uneven_micro_batches)
    assert [r["ep2"]["records"] for r in results] == [1, 3]  # fillers return no record
    # the TP1 "DP2" run sums two copies of the whole batch's share: twice the EP2 gradient
    assert abs(results[0]["tp1"]["grad_norm"] - 2 * results[0]["ep2"]["grad_norm"]) < 1e-5


def _uneven_with_router_losses() -> dict:
    """As above with the router losses on: the same uneven split at EP1 (DP2) and EP2 (one filler on rank 0),
    and the whole batch on each rank for the logged losses' true value."""
    arch = tiny_arch("qwen3_moe")
    tokens, labels = _global_batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    out = {}
    uneven = [0] if dist.get_rank() == 0 else [1, 2, 3]
    for name, parallel, rows in (("whole", {}, [0, 1, 2, 3]), ("ep1", {}, uneven), ("ep2", EP2, uneven)):
        with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
            engine = TrainEngine.build(arch, ctx, ROUTER_LOSSES, OPTIM)
            engine.load_full_state(full)
            engine.train_step(row_batches(tokens, labels, arch.vocab_size, rows), _ce_loss)
            after = gather_full_state(engine.models, arch, ctx)
            out[name] = {
                "load_balancing": engine.router_losses.load_balancing,
                "z_loss": engine.router_losses.z_loss,
                "router_after": after["decoder.layers.0.mlp.router.weight"],
            }
    return out


def test_fillers_and_uneven_ranks_leave_the_router_losses_alone(run_distributed):
    """A filler ran its routers in training mode, adding the load-balancing and z-losses of its padding to
    the update (EP2 moved a router's gradient 4.5% off EP1's) and to the logged values; a rank's own
    micro-batch count times DP divided the logged sums (rank 0, with 1 of 4, logged twice the loss)."""
    for result in run_distributed(_uneven_with_router_losses):
        whole = result["whole"]
        for name in ("ep1", "ep2"):
            for loss in ("load_balancing", "z_loss"):
                assert abs(result[name][loss] - whole[loss]) < 1e-5, (
                    name,
                    loss,
                    result[name][loss],
                    whole[loss],
                )
        diff = (result["ep2"]["router_after"] - result["ep1"]["router_after"]).abs().max()
        assert float(diff) < 1e-6


def test_the_routers_scale_their_losses_by_the_tokens_as_the_engine_scales_by_all_tokens() -> None:
    """megatron's TopKRouter copies ``calculate_per_token_loss`` when it is built and attaches ``loss * tokens``
    only with it; the engine scales the router terms by 1 / (every token of the step), so a router built
    before the flag was set added its losses about a micro-batch's token count too weakly."""
    from megatron.core.transformer.moe.router import TopKRouter

    arch = tiny_arch("qwen3_moe")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx, ROUTER_LOSSES, OPTIM)
        routers = [m for model in engine.models for m in model.modules() if isinstance(m, TopKRouter)]
        assert routers and all(r.calculate_per_token_loss for r in routers)
