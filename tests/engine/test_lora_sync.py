"""LoRA through the 3D-HybridEngine: the rollout engine gets the merged weights, merged shard by shard on each
training rank (each merged shard is the TP shard of the merged full weight), resharded to another rollout TP;
its log-probs equal the actor's (adapters on) within 1e-5 before and after an update of the adapters. A
mixture-of-experts model's adapters are on its attention, its experts split over two expert-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.lora import load_adapter_state, merge_full_state, rollout_parameters
from mcore_rl.engine.lora_spec import LoRASpec, resolve_targets
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.parallel import test_hybrid_moe as moe
from tests.parallel.test_hybrid_parity import (
    BASE,
    PROMPTS,
    TEMPERATURE,
    _full_state,
    _train_batches,
    actor_log_probs,
)

ARCH = ModelArch.from_hf_config({**BASE, "num_key_value_heads": 4})  # GQA: 2 query heads per group
SPEC = LoRASpec(
    rank=4, alpha=8.0, targets=resolve_targets(["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"])
)
# A mixture-of-experts model (top-2 of 4 experts, layer 1 dense, routers decisive) adapts its attention
MODELS = {
    "dense": (ARCH, SPEC, _full_state),
    "moe": (
        ModelArch.from_hf_config(moe.MOE),
        LoRASpec(4, 8.0, ("q_proj", "v_proj", "o_proj")),
        moe._full_state,
    ),
}


def random_adapters(spec: LoRASpec, arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    from mcore_rl.engine.hf.peft import adapter_shapes

    generator = torch.Generator().manual_seed(seed)
    return {
        k: 0.1 * torch.randn(shape, generator=generator) for k, shape in adapter_shapes(spec, arch).items()
    }


def synced(parallel: dict, tp_g: int, model: str = "dense") -> dict:
    arch, spec, full_state = MODELS[model]
    base, adapters = full_state(arch, 5), random_adapters(spec, arch, 6)
    optim = OptimConfig(weight_decay=0.0, lr=1e-2)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(lora=spec), optim)
        engine.load_full_state(base)
        load_adapter_state(engine.chunks, adapters, arch, ctx, "test")
        merged = gather_full_state(engine.models, arch, ctx, rollout_parameters(engine.models, arch, ctx))
        expected = merge_full_state(base, adapters, spec, arch)
        merge_gap = max((merged[k] - v).abs().max().item() for k, v in expected.items())
        hybrid, rollout = build_local_hybrid(engine, tp_g)
        merges, read = [0], hybrid.local_params
        hybrid.local_params = lambda: merges.__setitem__(0, merges[0] + 1) or read()  # type: ignore[method-assign]
        gaps = []
        for step in range(2):
            hybrid.to_rollout()
            hybrid.received_bytes_all_ranks()  # the sync's metric: no second merge of every adapted weight
            out = rollout.generate(
                PROMPTS, SamplingParams(temperature=TEMPERATURE, n=2, max_new_tokens=6, seed=step)
            )
            hybrid.to_train()
            actor = actor_log_probs(engine, ctx, out, arch.vocab_size)
            if actor is not None:
                gaps.append(float((actor - out.log_probs)[out.response_mask()].abs().max()))
            engine.train_step(_train_batches(ctx), lambda o, mb: (o.float().logsumexp(-1).mean(), {}))
        keys = merged.keys() == expected.keys()
        return {"merge_gap": merge_gap, "gaps": gaps, "keys": keys, "merges": merges[0]}


@pytest.mark.parametrize(
    ("parallel", "tp_g", "model"),
    [
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 1, "dense"),
        ({"pipeline_model_parallel_size": 2}, 2, "dense"),
        ({"expert_model_parallel_size": 2}, 2, "moe"),
    ],
    ids=["tp2-sp-to-rollout-tp1", "pp2-to-rollout-tp2", "moe-ep2-to-rollout-tp2"],
)
def test_rollout_gets_the_merged_weights(run_distributed, parallel, tp_g, model):
    results = run_distributed(synced, parallel, tp_g, model)
    assert all(r["keys"] and r["merge_gap"] <= 1e-6 for r in results)  # no adapter name reaches the plan
    assert all(r["merges"] == 2 for r in results)  # one merge per sync
    gaps = [g for r in results for g in r["gaps"]]
    assert len(gaps) >= 2 and max(gaps) <= 1e-5, gaps
