"""CPU-only speed-ups of issue 17 that must not change results: the weight-gradient GEMM into DDP's buffer
(``compat.megatron_cpu.fuse_weight_grad_accumulation``), the rollout running outside megatron's CPU mode
(``megatron_cpu.suspended``)."""

from __future__ import annotations

import torch

from mcore_rl.compat import megatron_cpu
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch


def _linears(engine: TrainEngine) -> list:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear)  # a tied output layer has no weight of its own
    return [m for m in engine.models[0].modules() if isinstance(m, kinds) and m.weight is not None]


def _grads_with_and_without_fusion() -> dict:
    arch = tiny_arch("qwen2")  # GQA and QKV biases
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (3, 10), generator=gen)
    batches = [MicroBatch(tokens[i : i + 1], torch.arange(10).expand(1, 10)) for i in range(3)]
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-3))
        linears = _linears(engine)
        fused_at_build = [m.gradient_accumulation_fusion for m in linears]
        grads = {}
        for fused in (True, False):
            for m in linears:
                m.gradient_accumulation_fusion = fused
            engine.zero_grad()  # three micro-batches: the fused GEMM accumulates across them
            engine.forward_backward(batches, lambda out, mb: (out.float().square().mean(), {}))
            grads[fused] = {n: p.main_grad.clone() for n, p in engine.chunks[0].named_parameters()}
        return {"fused_at_build": fused_at_build, "grads": grads}


def test_weight_grads_go_straight_into_ddp_buffers_with_the_same_values(run_distributed) -> None:
    (out,) = run_distributed(_grads_with_and_without_fusion, world_size=1)
    assert out["fused_at_build"] and all(out["fused_at_build"])
    fused, plain = out["grads"][True], out["grads"][False]
    assert fused.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=0, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in plain.values()) > 1e-3  # not two zero gradients


def _grads_on_each_gemm() -> dict:
    """One forward-backward per GEMM choice, counting the products that reach ``ops.gemm``."""
    import os

    from mcore_rl.ops import gemm

    arch = tiny_arch("qwen2")
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    batches = [MicroBatch(tokens[i : i + 1], torch.arange(12).expand(1, 12)) for i in range(2)]
    calls = {"gemm": 0, "gemm_into": 0}
    originals = {name: getattr(gemm, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    out: dict = {"pays": gemm.onednn_pays(torch.device("cpu"), torch.float32)}
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-3))
        for choice in ("auto", "aten"):
            os.environ.pop("MCORE_RL_GEMM", None) if choice == "auto" else os.environ.update(
                MCORE_RL_GEMM="aten"
            )
            for name in calls:
                calls[name] = 0
                setattr(gemm, name, counting(name))
            try:
                engine.zero_grad()
                engine.forward_backward(batches, lambda o, mb: (o.float().square().mean(), {}))
            finally:
                for name, fn in originals.items():
                    setattr(gemm, name, fn)
            grads = {n: p.main_grad.clone() for n, p in engine.chunks[0].named_parameters()}
            out[choice] = {"calls": dict(calls), "grads": grads}
        os.environ.pop("MCORE_RL_GEMM", None)
    return out


def test_megatron_linears_run_on_ops_gemm_with_the_same_gradients(run_distributed) -> None:
    """Forward, input gradient and fused weight gradient of every linear go through ``ops.gemm`` (oneDNN where
    it pays, ATen's GEMM otherwise: then the op is still called and falls back); either GEMM, the same
    gradients within fp32 rounding."""
    (out,) = run_distributed(_grads_on_each_gemm, world_size=1)
    layers = tiny_arch("qwen2").num_layers
    auto = out["auto"]["calls"]
    if out["pays"]:  # 4 linears a layer: forward + input gradient each; every weight gradient fused
        assert auto["gemm"] >= 2 * 2 * 4 * layers and auto["gemm_into"] >= 2 * 4 * layers, auto
    for name, grad in out["aten"]["grads"].items():
        torch.testing.assert_close(out["auto"]["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert out["aten"]["calls"]["gemm"] == 0  # ATen's GEMM chosen: megatron's products are not routed


def _modes_seen_by_the_rollout() -> dict:
    from mcore_rl.engine.rollout import local

    seen = []
    original = local.sample_tokens

    def recording(*args, **kwargs):
        seen.append(torch.overrides._get_current_function_mode())
        return original(*args, **kwargs)

    from tests.engine.rollout.common import make_engine, random_full_state

    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()):
        active = torch.overrides._get_current_function_mode()
        engine = make_engine(arch, random_full_state(arch, seed=1))
        local.sample_tokens = recording
        try:
            from mcore_rl.engine.rollout import SamplingParams

            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0))
        finally:
            local.sample_tokens = original
        after = torch.overrides._get_current_function_mode()
    return {
        "active": type(active).__name__,
        "seen": [type(m).__name__ for m in seen],
        "after": type(after).__name__,
    }


def test_the_rollout_runs_outside_megatrons_cpu_mode_and_restores_it(run_distributed) -> None:
    (out,) = run_distributed(_modes_seen_by_the_rollout, world_size=1)
    assert out["active"] == "MegatronCudaToCpuMode" == out["after"]
    assert out["seen"] and set(out["seen"]) == {"NoneType"}


def test_suspended_leaves_other_modes_alone() -> None:
    class Other(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Other() as other, megatron_cpu.suspended():  # ours is not innermost (or not active): a no-op
        assert torch.overrides._get_current_function_mode() is other
