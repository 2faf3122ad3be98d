"""PPO with a critic on one in-process rank (CPU, fp32): GAE through the driver equals ``mcore_rl.algo`` on the
same batch, the in-reward KL equals ``apply_kl_penalty`` with the adaptive controller's coefficient, the
critic warm-up freezes the actor while the critic learns, and the config refuses what the driver cannot run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mcore_rl.algo import AdaptiveKLController, apply_kl_penalty, compute_gae_advantages
from mcore_rl.algo.advantages import outcome_rewards
from mcore_rl.config import ConfigError
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, build_critic_group, worker_spec
from mcore_rl.trainer.ppo import PPOStep
from tests.trainer.common import MIXED_REWARD, tiny_run_config

PPO = [
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=0.9",
    "algorithm.lam=0.8",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=low_var_kl",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.2",
    "algorithm.kl_ctrl.target_kl=0.01",
    "algorithm.kl_ctrl.horizon=64",
    "critic.warmup_steps=1",
    "critic.optim.lr=1e-3",
    "critic.ppo_micro_batch_size_per_gpu=4",
    MIXED_REWARD,
]


@pytest.fixture(scope="module")
def ppo(tmp_path_factory) -> Iterator[tuple]:
    cfg = tiny_run_config(str(tmp_path_factory.mktemp("ppo")), PPO)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    loader = PromptLoader(PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=10), use_ray=False)
    critic = build_critic_group(cfg, actors, total_optimizer_steps=10)
    with RewardScorer(cfg.reward) as scorer:
        yield cfg, actors, critic, PPOStep(cfg, actors, critic, tokenizer, scorer), loader
    actors.shutdown()


def test_gae_and_kl_in_reward_through_the_driver_equal_the_algorithms(ppo) -> None:
    _, _, critic, step, loader = ppo
    coef = step.kl_ctrl.value
    batch = step.prepare(loader.next_batch(), step=7)
    mask, rollout = batch.rollout.response_mask, batch.rollout
    assert batch.values.shape == mask.shape and batch.values.abs().sum() > 0
    assert torch.equal(critic.submit_values(rollout, 4)(), batch.values)  # the critic's own values
    kl = apply_kl_penalty(
        outcome_rewards(batch.scored.scores, mask),
        batch.log_probs.actor_log_probs,
        batch.log_probs.ref_log_probs,
        mask,
        kl_coef=coef,
        estimator="low_var_kl",
    )
    assert torch.equal(batch.rewards, kl.rewards)
    gae = compute_gae_advantages(kl.rewards, batch.values, mask, gamma=0.9, lam=0.8)
    assert torch.equal(batch.advantages, gae.advantages) and torch.equal(batch.returns, gae.returns)
    expected = AdaptiveKLController(coef, 0.01, 64)
    expected.update(kl.mean_kl, n_steps=mask.shape[0])
    assert step.kl_ctrl.value == expected.value and batch.kl_in_reward["kl_in_reward/coef"] == coef
    step.actors.sync_weights()  # back to ROLLOUT for the next test


def test_warm_up_trains_the_critic_alone_then_the_actor(ppo) -> None:
    _, actors, critic, step, loader = ppo
    probe = step.prepare(loader.next_batch(), step=8).rollout
    values_before = critic.submit_values(probe, 4)()
    log_probs_before = actors.submit_log_probs(probe, 1.0, 8)().actor_log_probs
    actors.sync_weights()
    warm = step.run(loader.next_batch(), 1).metrics()  # step 1 <= critic.warmup_steps
    assert warm["actor_frozen"] == 1.0 and warm["num_optimizer_steps"] == 0
    assert warm["critic/grad_norm"] > 0 and warm["critic/lr"] == pytest.approx(1e-3)
    assert torch.equal(actors.submit_log_probs(probe, 1.0, 8)().actor_log_probs, log_probs_before)
    assert not torch.allclose(critic.submit_values(probe, 4)(), values_before)
    actors.sync_weights()
    trained = step.run(loader.next_batch(), 2).metrics()
    assert trained["actor_frozen"] == 0.0 and trained["num_optimizer_steps"] == 1
    assert not torch.allclose(actors.submit_log_probs(probe, 1.0, 8)().actor_log_probs, log_probs_before)
    assert {"critic/vf_loss", "critic/vf_clip_frac", "kl_in_reward/mean_kl"} <= set(trained)
    actors.sync_weights()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["critic.cliprange_value=-1"], "critic.cliprange_value=-1.0 must be >= 0"),
        (["critic.parallel.tensor_model_parallel_size=2"], "critic.parallel differs from parallel"),
        (
            [
                "algorithm.adv_estimator=gae",
                "critic.colocate=false",
                "critic.parallel.pipeline_model_parallel_size=2",
            ],
            "critic.parallel: TP\\*PP = 2 does not divide the critic's 1 ranks",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=3"],
            "critic.ppo_micro_batch_size_per_gpu=3 does not divide",
        ),
    ],
)
def test_critic_config_errors_name_the_key(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_run_config(str(tmp_path), overrides)


def test_kl_in_reward_without_a_critic_is_refused_naming_the_key(tmp_path) -> None:
    """Refused with the config's other rules (``mcore-rl config show --check`` too), before any run folder."""
    with pytest.raises(
        ConfigError, match=r"algorithm\.use_kl_in_reward=true needs algorithm\.adv_estimator=gae"
    ):
        tiny_run_config(str(tmp_path), ["algorithm.use_kl_in_reward=true"])  # GRPO: outcome scores only


def test_the_actor_lr_schedule_ends_after_the_critic_warm_up(tmp_path) -> None:
    from mcore_rl.trainer.trainer import actor_optimizer_steps

    overrides = ["algorithm.ppo_mini_batch_size=4", "algorithm.ppo_epochs=2", "critic.warmup_steps=3"]
    ppo_cfg = tiny_run_config(str(tmp_path), ["algorithm.adv_estimator=gae", *overrides])
    assert actor_optimizer_steps(ppo_cfg, 10) == (10 - 3) * 2 * 2  # frozen steps take no optimizer step
    assert actor_optimizer_steps(ppo_cfg, 2) == 0
    grpo_cfg = tiny_run_config(str(tmp_path), overrides)  # the warm-up is PPO's alone
    assert actor_optimizer_steps(grpo_cfg, 10) == 10 * 2 * 2


def test_the_critic_spec_follows_its_own_layout_and_the_actors_router_losses(tmp_path) -> None:
    """A critic pool at PP2 took the actor's packing (PP1 only: it failed at its first pass); a MoE critic's
    routers trained without the load-balancing and z-losses the actor's have."""
    from mcore_rl.trainer.build import critic_spec

    pool = ["algorithm.adv_estimator=gae", "critic.colocate=false", "critic.num_ranks=2"]
    pp2 = tiny_run_config(str(tmp_path), [*pool, "critic.parallel.pipeline_model_parallel_size=2"])
    assert pp2.model.use_remove_padding and not critic_spec(pp2, 1).remove_padding
    assert critic_spec(
        tiny_run_config(str(tmp_path), pool), 1
    ).remove_padding  # its own PP1 packs as the actor
    losses = ["algorithm.adv_estimator=gae", "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]
    spec = critic_spec(tiny_run_config(str(tmp_path / "moe"), losses, family="qwen3_moe"), 1)
    assert (spec.moe_aux_loss_coeff, spec.moe_z_loss_coeff) == (0.01, 0.001)
