"""The RL driver on a mixture-of-experts policy at EP2 through Ray: two Qwen3-MoE ranks, each with half of
every MoE layer's experts, the embedded rollout engine synced by the zero-redundancy reshard every step.

Every step's ``token_mult_prob_error`` is 1 within 1e-3 (fp32: the rollout routes as the trainer does), the
routers agree with the rollout's recorded choices on every token, the load-balancing loss is logged, and each
rank receives exactly the other rank's experts' bytes (the plan's minimum).
"""

from __future__ import annotations

import os

import pytest

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, QUIET, tiny_run_config


@pytest.mark.usefixtures("ray_session")
def test_grpo_on_moe_at_ep2_keeps_rollout_and_trainer_in_agreement(tmp_path) -> None:
    cfg = tiny_run_config(
        str(tmp_path),
        [
            *QUIET,
            MIXED_REWARD,
            "trainer.n_gpus_per_node=2",
            "parallel.expert_model_parallel_size=2",
            "trainer.total_training_steps=2",
        ],
        family="qwen3_moe",
    )
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        records = [r for r in trainer.records if r["stage"] == "rl" and r["step"] > 0]
    # the run's HF model (inline config: model_type added) loads in transformers as a Qwen3-MoE
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "run", "model"))
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    assert len(records) == 2
    moe = cfg.model.arch().moe
    assert moe is not None
    # per MoE layer each rank receives the 2 experts it does not hold: fc1 [2f, h] + fc2 [h, f] each, fp32
    expert_bytes = 3 * moe.ffn_hidden_size * cfg.model.arch().hidden_size * 4
    for r in records:
        assert abs(r["token_mult_prob_error"] - 1.0) < 1e-3, r
        assert r["moe_router_agreement"] == 1.0
        assert r["moe_load_balancing_loss"] > 0.5  # Qwen3-MoE's router_aux_loss_coef (0.001) is on
        assert r["sync/received_bytes"] >= len(moe.layers) * 2 * expert_bytes
