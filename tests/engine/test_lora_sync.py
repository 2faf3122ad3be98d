"""LoRA through the 3D-HybridEngine: the rollout engine gets the merged weights, merged shard by shard on each
training rank (each merged shard is the TP shard of the merged full weight), resharded to another rollout TP;
its log-probs equal the actor's (adapters on) within 1e-5 before and after an update of the adapters."""

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


def random_adapters(spec: LoRASpec, arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    from mcore_rl.engine.hf.peft import adapter_shapes

    generator = torch.Generator().manual_seed(seed)
    return {
        k: 0.1 * torch.randn(shape, generator=generator) for k, shape in adapter_shapes(spec, arch).items()
    }


def synced(parallel: dict, tp_g: int) -> dict:
    base, adapters = _full_state(ARCH, 5), random_adapters(SPEC, ARCH, 6)
    optim = OptimConfig(weight_decay=0.0, lr=1e-2)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(ARCH, ctx, ModelOptions(lora=SPEC), optim)
        engine.load_full_state(base)
        load_adapter_state(engine.chunks, adapters, ARCH, ctx, "test")
        merged = gather_full_state(engine.models, ARCH, ctx, rollout_parameters(engine.models, ARCH, ctx))
        expected = merge_full_state(base, adapters, SPEC, ARCH)
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
            actor = actor_log_probs(engine, ctx, out, ARCH.vocab_size)
            if actor is not None:
                gaps.append(float((actor - out.log_probs)[out.response_mask()].abs().max()))
            engine.train_step(_train_batches(ctx), lambda o, mb: (o.float().logsumexp(-1).mean(), {}))
        keys = merged.keys() == expected.keys()
        return {"merge_gap": merge_gap, "gaps": gaps, "keys": keys, "merges": merges[0]}


@pytest.mark.parametrize(
    ("parallel", "tp_g"),
    [
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 1),
        ({"pipeline_model_parallel_size": 2}, 2),
    ],
    ids=["tp2-sp-to-rollout-tp1", "pp2-to-rollout-tp2"],
)
def test_rollout_gets_the_merged_weights(run_distributed, parallel, tp_g):
    results = run_distributed(synced, parallel, tp_g)
    assert all(r["keys"] and r["merge_gap"] <= 1e-6 for r in results)  # no adapter name reaches the plan
    assert all(r["merges"] == 2 for r in results)  # one merge per sync
    gaps = [g for r in results for g in r["gaps"]]
    assert len(gaps) >= 2 and max(gaps) <= 1e-5, gaps
