"""The switch and rollout phases against what the hybrid engine holds: the critic's state stays on the GPU
(only the actor's is offloaded), the reshard's new output shards live beside the rollout engine's weights
until the load (measured on gloo ranks), and the rollout runs in ``rollout_dtype``."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.engine.arch import ModelArch
from mcore_rl.planner import PlanError, PlanInput, plan_memory
from mcore_rl.planner.from_config import plan_input_from_config
from mcore_rl.planner.memory import reshard_output_bytes, rollout_weight_bytes
from mcore_rl.planner.report import describe_layout
from tests.models import tiny_arch
from tests.planner.hf_configs import LLAMA31_8B, LLAMA31_70B, QWEN3_8B

GIB = 1 << 30


def _plan(hf_config: dict, **changes) -> PlanInput:
    fields = dict(
        arch=ModelArch.from_hf_config(hf_config),
        gpu="A100-80",
        world_size=8,
        tp=2,
        sp=True,
        seq_length=4096,
        global_batch_size=256,
        recompute="full",
        rollout_tp=2,
    )
    fields.update(changes)
    return PlanInput(**fields)


def test_a_colocated_critic_keeps_its_gradients_and_optimizer_in_the_switch_and_the_rollout():
    result = plan_memory(_plan(QWEN3_8B, critic=True, reference=True))
    train = result.train.terms
    for phase in (result.switch, result.rollout):
        # HybridEngine offloads the actor's state alone; the critic is a training engine of its own.
        assert "gradients" not in phase.terms and "optimizer" not in phase.terms
        assert phase.terms["critic gradients"] == train["critic gradients"]
        assert phase.terms["critic optimizer"] == train["critic optimizer"]
    # 62.31 GiB without the critic's 14.10 + 10.57 GiB: the rollout phase does not fit 77 GiB.
    assert round(result.rollout.total_bytes / GIB, 2) == 86.98
    assert not result.fits and result.problems[0].startswith("rollout phase needs 86.98 GiB > 77.00 GiB")


def test_the_switch_holds_the_reshard_output_beside_the_rollout_weights():
    # TP8 -> rollout TP4: every rollout shard but the replicated norms (80 layers x 2 + 1 of 8,192) is a new
    # tensor, alive with the engine's (woken) weights until the load has copied it in:
    # 16.43 + 32.86 + 32.86 GiB, + 0.5 GiB of reshard buffers.
    result = plan_memory(_plan(LLAMA31_70B, world_size=32, tp=8, rollout_tp=4))
    switch = result.switch.terms
    assert switch["rollout weights"] == rollout_weight_bytes(result.plan)
    assert switch["reshard output"] == switch["rollout weights"] - 2 * (80 * 2 + 1) * 8192
    assert round(result.switch.total_bytes / GIB, 2) == 82.65
    assert not result.fits and result.problems[0].startswith("switch phase needs 82.65 GiB")
    # Same TP, no cast, a vocab 128 x TP divides: every shard is the training tensor, nothing new.
    same = plan_memory(_plan(LLAMA31_8B))
    assert "reshard output" not in same.switch.terms and reshard_output_bytes(same.plan) == 0
    # A cast allocates every shard.
    fp32 = _plan(LLAMA31_8B, rollout_dtype="float32")
    assert reshard_output_bytes(fp32) == rollout_weight_bytes(fp32) == 2 * rollout_weight_bytes(same.plan)
    # PP2: the first stage's rank gets the other stage's 16 layers (109,060,096 parameters each at TP2), the
    # final norm and the output layer's 64,128 x 4,096 rows.
    assert reshard_output_bytes(_plan(LLAMA31_8B, pp=2)) == 2 * (16 * 109_060_096 + 4096 + 64_128 * 4096)


CASES = [(2, 1, 1, None), (1, 2, 1, None), (2, 1, 2, None), (1, 1, 1, "bfloat16")]
"""(tp, pp, rollout tp, rollout dtype) of an fp32 tiny Llama on 2 ranks: a TP change, PP2 at the same TP,
the same TP (its 250-row vocab padded to 256: the vocab tables are new), a cast."""


def _tiny(tp: int, pp: int, rollout_tp: int, rollout_dtype: str | None) -> PlanInput:
    return PlanInput(
        arch=tiny_arch("llama"),
        gpu="A100-80",
        world_size=2,
        tp=tp,
        pp=pp,
        seq_length=16,
        bf16=False,
        rollout_tp=rollout_tp,
        rollout_dtype=rollout_dtype,
    )


def _measure_reshard_output() -> list[tuple[int, int]]:
    """Per case: (bytes of every rollout shard, bytes of those that are not a training tensor) at the load."""
    from mcore_rl.engine.local_hybrid import build_local_hybrid
    from mcore_rl.engine.model import ModelOptions
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.config import HybridConfig, ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    measured = []
    for tp, pp, rollout_tp, rollout_dtype in CASES:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        with ParallelContext.initialize(parallel) as ctx:
            arch = tiny_arch("llama")
            engine = TrainEngine.build(arch, ctx, ModelOptions(dtype=torch.float32), OptimConfig())
            config = HybridConfig(rollout_dtype=rollout_dtype, sleep_level=2)
            hybrid, _ = build_local_hybrid(engine, rollout_tp, config)
            training = {p.untyped_storage().data_ptr() for m in engine.models for p in m.parameters()}
            seen: list[tuple[int, int]] = []
            to_rollout_tensors = hybrid.to_rollout_tensors

            def spy(shards, to_rollout_tensors=to_rollout_tensors, seen=seen, training=training):
                sizes = [
                    (t.untyped_storage().data_ptr(), t.numel() * t.element_size()) for t in shards.values()
                ]
                seen.append((sum(n for _, n in sizes), sum(n for ptr, n in sizes if ptr not in training)))
                return to_rollout_tensors(shards)

            hybrid.to_rollout_tensors = spy
            hybrid.to_rollout()
            measured.append(seen[0])
    return measured


def test_reshard_output_is_what_the_executor_allocates(run_distributed):
    ranks = run_distributed(_measure_reshard_output, world_size=2)
    for i, case in enumerate(CASES):
        plan = _tiny(*case)
        assert all(rank[i][0] == rollout_weight_bytes(plan) for rank in ranks), (case, ranks)
        assert max(rank[i][1] for rank in ranks) == reshard_output_bytes(plan), (case, ranks)
    assert reshard_output_bytes(_tiny(1, 2, 1, None)) < rollout_weight_bytes(_tiny(1, 2, 1, None))


def test_the_rollout_runs_in_rollout_dtype():
    bf16 = plan_memory(_plan(QWEN3_8B, seq_length=16384, rollout_tp=1))
    fp32 = plan_memory(_plan(QWEN3_8B, seq_length=16384, rollout_tp=1, rollout_dtype="float32"))
    assert fp32.rollout.terms["rollout weights"] == 2 * bf16.rollout.terms["rollout weights"]
    assert round(fp32.rollout.terms["rollout weights"] / GIB, 2) == 30.51
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token == 294_912  # 2 x 36 x 8 x 128 x 4 B
    assert fp32.rollout.terms["rollout activations"] > bf16.rollout.terms["rollout activations"]
    assert bf16.kv_cache_tokens == 174_115 and fp32.kv_cache_tokens < 31_510
    assert "rollout_tp=1 rollout_dtype=float32 " in describe_layout(fp32)
    with pytest.raises(PlanError, match=r"rollout_dtype='int8' must be None or one of"):
        _plan(QWEN3_8B, rollout_dtype="int8")


def test_config_rollout_dtype_reaches_the_planner(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    recipe, path = "recipes/qwen3_8b_grpo_h100.yaml", f"model.path={tmp_path}"
    cast = plan_input_from_config(
        load_config(recipe, [path, "rollout.hybrid.rollout_dtype=float32"]), gpu="H100-80"
    )
    assert cast.bf16 and cast.rollout_dtype == "float32" and cast.rollout_element_bytes == 4
    same = plan_input_from_config(
        load_config(recipe, [path, "rollout.hybrid.rollout_dtype=bfloat16"]), gpu="H100-80"
    )
    assert same.rollout_dtype is None and same.rollout_element_bytes == 2  # the model's dtype: no cast
