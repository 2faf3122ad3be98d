"""The RL step on one in-process rank (no Ray): the reference policy and KL loss, the LR warmup through
megatron's scheduler, the log-prob agreement metric, and a NaN loss that must not reach the weights."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.engine.train_engine import NonFiniteLossError
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, worker_spec
from mcore_rl.trainer.groups.actor import UpdatePlan
from mcore_rl.trainer.grpo import GRPOStep
from mcore_rl.trainer.step import loss_settings
from mcore_rl.types import RolloutRequest, TrainBatch
from tests.trainer.common import MIXED_REWARD, tiny_run_config


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[tuple]:
    cfg = tiny_run_config(
        str(tmp_path_factory.mktemp("run")),
        ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "optim.lr_warmup_steps=2", MIXED_REWARD],
    )
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    loader = PromptLoader(PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=10), use_ray=False)
    with RewardScorer(cfg.reward) as scorer:
        yield cfg, actors, GRPOStep(cfg, actors, tokenizer, scorer), loader
    actors.shutdown()


def test_steps_warm_up_the_lr_keep_log_probs_in_agreement_and_grow_the_kl(run) -> None:
    _, _, step, loader = run
    metrics = [step.run(loader.next_batch(), s).metrics() for s in (1, 2)]
    assert [m["lr"] for m in metrics] == pytest.approx([0.5e-3, 1e-3])  # linear warmup over 2 steps
    for m in metrics:
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-6  # rollout engine == trainer
        assert m["clip_frac"] == 0.0 and abs(m["approx_kl"]) < 1e-6  # one mini-batch: on-policy
        assert m["clip_frac_lower"] == 0.0 and 0.0 <= m["response_clip_ratio"] <= 1.0  # verl's names for both
        assert 0.0 < m["reward"] < 1.0 and m["grad_norm"] > 0 and m["num_optimizer_steps"] == 1
    assert metrics[0]["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # the reference is the initial actor
    assert metrics[1]["kl_loss"] > 1e-6  # ... and stays frozen while the actor moves
    assert set(metrics[0]) >= {"time/generate_s", "time/update_s", "time/sync_s", "tokens_per_s"}
    for phase in ("generate", "log_probs", "update", "sync"):  # peak RSS per phase, above the bare runtime
        assert all(m[f"memory/{phase}_rss_bytes"] > 50e6 for m in metrics), phase


def test_a_nan_loss_stops_the_update_without_touching_the_weights_or_is_skipped(run) -> None:
    cfg, actors, step, loader = run
    prompts = loader.next_batch()
    rollout = actors.generate(
        RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts))), step.sampling(9)
    )
    before = actors.submit_log_probs(rollout, cfg.rollout.temperature, 8)()
    nan_adv = torch.full(rollout.response_mask.shape, math.nan)
    batch = TrainBatch(
        rollout.tokens, rollout.response_mask, before.actor_log_probs, nan_adv, before.ref_log_probs
    )
    with pytest.raises(NonFiniteLossError, match="NaN/inf loss"):
        actors.update(batch, loss_settings(cfg), UpdatePlan(1, 1, 8, "stop"))
    after = actors.submit_log_probs(rollout, cfg.rollout.temperature, 8)()
    assert torch.equal(before.actor_log_probs, after.actor_log_probs)
    stats = actors.update(batch, loss_settings(cfg), UpdatePlan(1, 1, 8, "skip"))
    assert stats.num_skipped == 1 and stats.num_optimizer_steps == 0
    assert torch.equal(
        actors.submit_log_probs(rollout, cfg.rollout.temperature, 8)().actor_log_probs, before.actor_log_probs
    )
    actors.sync_weights()
