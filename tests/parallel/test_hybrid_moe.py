"""3D-HybridEngine on mixture-of-experts models: expert-parallel train layouts -> rollout TP.

As ``test_hybrid_parity.py`` for dense models: the rollout engine's log-probs on its own samples equal the
actor's recomputed ones (fp32, 1e-5) before and after a training step, and every reshard receives exactly the
bytes the plan says, which the plan tests prove minimal (each EP rank keeps its own experts' slices and
receives only the other experts'). The routers get logits of std ~1 so that fp32 rounding never flips a
top-k choice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.reshard import arch_param_specs
from mcore_rl.parallel.sharding import ShardKind
from tests.parallel import test_hybrid_parity as dense

MOE = {
    **dense.BASE,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "tie_word_embeddings": True,
}
EP = {"expert_model_parallel_size": 2}
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "tp1-dp4-ep4": ({"expert_model_parallel_size": 4}, (2,)),
    "tp2-sp-ep2": ({"tensor_model_parallel_size": 2, "sequence_parallel": True, **EP}, (4,)),
    "tp2-sp-ep2-etp1": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1, **EP},
        (1, 2),
    ),
    "pp2-ep2": ({"pipeline_model_parallel_size": 2, **EP}, (1, 2, 4)),
}
DEFAULT = ("tp2-sp-ep2",)  # PP2xEP2 (24 s of CI) runs in `make test-sweep` with the other layouts


def _full_state(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for spec in arch_param_specs(arch):
        noise = torch.randn(spec.shape, generator=gen)
        if spec.name.endswith("router.weight"):
            full[spec.name] = noise / arch.hidden_size**0.5 * 8  # logits of std ~1 on normed inputs
        elif spec.kind is ShardKind.REPLICATED and len(spec.shape) == 1 and "norm" in spec.name:
            full[spec.name] = 1.0 + 0.1 * noise
        else:
            full[spec.name] = 0.05 * noise
    return full


def run_moe_layout(parallel: dict[str, Any], rollout_tps: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    arch = ModelArch.from_hf_config(MOE)
    results = {}
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        for index, tp_g in enumerate(rollout_tps):  # the dense case's switch-train-switch body
            results[f"qwen3_moe/rollout-tp{tp_g}"] = dense._case(ctx, arch, tp_g, 300 + index, _full_state)
    return results


def _params(names: tuple[str, ...]) -> list[Any]:
    return [pytest.param(*LAYOUTS[n], id=n) for n in names]


@pytest.mark.parametrize(("parallel", "rollout_tps"), _params(DEFAULT))
def test_moe_rollout_log_probs_equal_actor_log_probs(run_distributed, parallel, rollout_tps):
    dense.check_layout(run_distributed(run_moe_layout, parallel, rollout_tps, world_size=dense.WORLD))


@pytest.mark.sweep
@pytest.mark.parametrize(("parallel", "rollout_tps"), _params(tuple(n for n in LAYOUTS if n not in DEFAULT)))
def test_moe_every_layout(run_distributed, parallel, rollout_tps):
    dense.check_layout(run_distributed(run_moe_layout, parallel, rollout_tps, world_size=dense.WORLD))
