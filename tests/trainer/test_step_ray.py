"""The RL step through Ray worker groups at actor layouts DP2, TP2 + SP (rollout TP2) and PP2 (slow).

Checks that hold only if dispatch and reduction are right: every prompt is sampled ``n`` times across the
rollout replicas (DP ranks sample different prompts); the trainer reproduces the rollout log-probs (so
shards came back in order); and on the first, on-policy mini-batch the DP-reduced policy loss equals
``-token_mean(advantages)`` of the whole batch, computed here on the driver.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo.advantages import compute_advantages
from mcore_rl.algo.agreement import prob_agreement
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, worker_spec
from mcore_rl.trainer.grpo import GRPOStep
from mcore_rl.trainer.step import loss_settings, update_plan
from mcore_rl.types import RolloutRequest, TrainBatch
from tests.trainer.common import MIXED_REWARD, tiny_run_config

pytestmark = pytest.mark.usefixtures("ray_session")

LAYOUTS = {
    "dp2": ["trainer.n_gpus_per_node=2"],
    "tp2_sp_rollout_tp2": [
        "trainer.n_gpus_per_node=2",
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "rollout.tensor_model_parallel_size=2",
    ],
    "pp2": ["trainer.n_gpus_per_node=2", "parallel.pipeline_model_parallel_size=2"],
}


# DP2 and PP2 in the sweep tier (CI time): the in-process step and the hybrid parity tests cover both layouts
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("dp2", marks=pytest.mark.sweep),
        "tp2_sp_rollout_tp2",
        pytest.param("pp2", marks=[pytest.mark.slow, pytest.mark.sweep]),
    ],
)
def test_rl_step_at_layout(layout: str, tmp_path) -> None:
    cfg = tiny_run_config(
        str(tmp_path), [*LAYOUTS[layout], MIXED_REWARD, "algorithm.ppo_micro_batch_size_per_gpu=4"]
    )
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    loader = PromptLoader(PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=4), use_ray=True)
    try:
        with RewardScorer(cfg.reward) as scorer:
            step = GRPOStep(cfg, actors, tokenizer, scorer)
            prompts = loader.next_batch()
            request = RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts)))
            rollout = actors.generate(request, step.sampling(1))
            assert rollout.prompt_index.tolist() == [p for p in range(8) for _ in range(4)]
            log_probs = actors.submit_log_probs(rollout, cfg.rollout.temperature, 4)()
            agreement = prob_agreement(
                rollout.rollout_log_probs, log_probs.actor_log_probs, rollout.response_mask
            )
            assert abs(agreement.token_mult_prob_error - 1.0) < 1e-5
            scores = step.score(rollout, prompts).scores
            mask = rollout.response_mask
            adv = compute_advantages("grpo", scores, mask, rollout.prompt_index)
            batch = TrainBatch(rollout.tokens, mask, log_probs.actor_log_probs, adv, log_probs.ref_log_probs)
            stats = actors.update(batch, loss_settings(cfg), update_plan(cfg))
            assert stats.pg_loss == pytest.approx(float(-(adv * mask).sum() / mask.sum()), abs=1e-5)
            assert stats.clip_frac == 0.0 and stats.grad_norm > 0
            actors.sync_weights()
            metrics = step.run(loader.next_batch(), 2).metrics()  # the whole step, on the updated weights
            assert abs(metrics["token_mult_prob_error"] - 1.0) < 1e-5 and metrics["num_optimizer_steps"] == 1
    finally:
        actors.shutdown()
