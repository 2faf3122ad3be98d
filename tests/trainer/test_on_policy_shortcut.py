"""``algorithm.recompute_old_log_probs``: verl's on-policy shortcut (issue 17).

``auto`` skips the actor's old-log-prob pass when the update is one optimizer step on a rollout of the
current weights: the update's own forward gives the old log-probs (detached) and the trainer log-probs of
``token_mult_prob_error``. Two runs from the same seed, ``auto`` and ``always``, must then log the same
metrics and end with the same weights; the pass must still run where it is not provably redundant (two
epochs, two mini-batches, a lagged rollout, PPO's in-reward KL).

Which pass ran is read from two independent places: the driver's ``old_log_probs_recomputed`` flag and the
worker's ``memory/log_probs_*`` phase record, which only a forward-only log-prob pass writes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.config import AlgorithmConfig, ModelConfig, RunConfig
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, build_critic_group, worker_spec
from mcore_rl.trainer.groups.actor import UpdatePlan
from mcore_rl.trainer.grpo import GRPOStep
from mcore_rl.trainer.on_policy import old_log_prob_line, recompute_old_log_probs, training_dropout
from mcore_rl.trainer.ppo import PPOStep
from tests.trainer.common import MIXED_REWARD, tiny_run_config

SAME = (
    "reward",
    "response_len",
    "pg_loss",
    "kl_loss",
    "entropy",
    "clip_frac",
    "approx_kl",
    "grad_norm",
    "token_mult_prob_error",
)
LOG_PROBS_PHASE = "memory/log_probs_rss_bytes"


def _tokenizer_and_loader(cfg: RunConfig) -> tuple[Tokenizer, PromptLoader]:
    assert cfg.model.tokenizer_path is not None
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    return tokenizer, PromptLoader(
        PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data
    )


def _run(folder: str, extra: list[str], steps: int = 2, use_ray: bool = False) -> tuple[list[dict], dict]:
    """``steps`` GRPO steps from the seeded initial weights; the metrics and the final full weights."""
    cfg = tiny_run_config(folder, [MIXED_REWARD, *extra])
    tokenizer, loader = _tokenizer_and_loader(cfg)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=4), use_ray=use_ray)
    try:
        with RewardScorer(cfg.reward) as scorer:
            step = GRPOStep(cfg, actors, tokenizer, scorer)
            metrics = [step.run(loader.next_batch(), s).metrics() for s in range(1, steps + 1)]
        weights = actors.backend.submit("full_state", None, "")()[0]
    finally:
        actors.shutdown()
    return metrics, weights


def _assert_same_run(auto: tuple[list[dict], dict], always: tuple[list[dict], dict]) -> None:
    (auto_metrics, auto_weights), (always_metrics, always_weights) = auto, always
    for a, b in zip(auto_metrics, always_metrics, strict=True):
        # a few fp32 ulps: grad_norm sums every weight's gradient (2.2663870 vs 2.2663853 seen)
        for key in SAME:
            assert a[key] == pytest.approx(b[key], rel=2e-6, abs=1e-6), key
        assert a["num_optimizer_steps"] == b["num_optimizer_steps"] == 1
    assert auto_weights.keys() == always_weights.keys()
    for name, weight in auto_weights.items():
        assert weight.dtype == torch.float32
        # Adam divides by the gradient's own scale, so ulp-level gradient differences on near-zero entries
        # move a weight by a small fraction of the learning rate (1e-3 here): up to 2.6e-5 seen at DP2 with
        # the token budget, where the two runs' GEMMs see their rows in different slices
        assert (weight - always_weights[name]).abs().max() <= 1e-4, name
    moved = [m["grad_norm"] > 0 for m in auto_metrics]
    assert all(moved) and auto_metrics[1]["pg_loss"] != auto_metrics[0]["pg_loss"]  # a real second step


def _assert_shortcut_taken(metrics: list[dict], reference: bool) -> None:
    for m in metrics:
        assert m["old_log_probs_recomputed"] == 0.0
        assert (LOG_PROBS_PHASE in m) == reference  # the reference's pass alone, for the KL loss
        assert m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0  # ratio exactly 1
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-5  # from the update's forward


def _assert_pass_ran(metrics: list[dict]) -> None:
    for m in metrics:
        assert m["old_log_probs_recomputed"] == 1.0
        assert m[LOG_PROBS_PHASE] > 0  # no reference in these runs: only the actor's pass records it


def test_decision_follows_the_update_shape_the_lag_and_the_in_reward_kl() -> None:
    one = UpdatePlan(num_mini_batches=1, ppo_epochs=1, micro_batch_size=8)
    algo = AlgorithmConfig(ppo_mini_batch_size=8)
    assert not recompute_old_log_probs(algo, one, policy_lag=0)
    assert recompute_old_log_probs(algo, one, policy_lag=1)  # one_step_off: the rollout is one update old
    assert recompute_old_log_probs(algo, dataclasses.replace(one, ppo_epochs=2), policy_lag=0)
    assert recompute_old_log_probs(algo, dataclasses.replace(one, num_mini_batches=2), policy_lag=0)
    assert recompute_old_log_probs(dataclasses.replace(algo, use_kl_in_reward=True), one, policy_lag=0)
    assert recompute_old_log_probs(dataclasses.replace(algo, recompute_old_log_probs="always"), one, 0)
    assert recompute_old_log_probs(
        algo, one, policy_lag=0, dropout=0.05
    )  # LoRA's: the update's forward drops
    line = old_log_prob_line(algo, one, 0, dropout=0.05)
    assert "the old-log-prob pass runs: model.lora_dropout=0.05" in line
    assert training_dropout(ModelConfig(lora_rank=8, lora_dropout=0.05)) == 0.05
    assert training_dropout(ModelConfig(lora_dropout=0.05)) == 0.0  # no adapters: nothing drops
    with pytest.raises(ValueError, match=r"algorithm\.recompute_old_log_probs='never'"):
        recompute_old_log_probs(dataclasses.replace(algo, recompute_old_log_probs="never"), one, 0)


def test_config_refuses_an_unknown_mode(tmp_path) -> None:
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm\.recompute_old_log_probs='sometimes'"):
        tiny_run_config(str(tmp_path), ["algorithm.recompute_old_log_probs=sometimes"])


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="plain"),
        # the reference still runs for the KL loss; the token budget reorders rows inside the worker
        pytest.param(
            [
                "algorithm.use_kl_loss=true",
                "algorithm.kl_loss_coef=0.1",
                "algorithm.ppo_max_token_len_per_gpu=40",
            ],
            id="kl_loss_token_budget",
        ),
        # GSPO's sequence ratio is exactly 1 on the update's own forward too
        pytest.param(["algorithm.policy_loss=gspo"], id="gspo"),
    ],
)
def test_auto_equals_always_at_dp1(tmp_path, extra: list[str]) -> None:
    data = str(tmp_path / "data")
    auto = _run(data, [*extra, f"trainer.default_local_dir={tmp_path / 'auto'}"])
    always = _run(
        data,
        [*extra, "algorithm.recompute_old_log_probs=always", f"trainer.default_local_dir={tmp_path / 'al'}"],
    )
    _assert_shortcut_taken(auto[0], reference="algorithm.use_kl_loss=true" in extra)
    for m in always[0]:
        assert m["old_log_probs_recomputed"] == 1.0 and m[LOG_PROBS_PHASE] > 0
    _assert_same_run(auto, always)


@pytest.mark.sweep  # 27 s: `make test-sweep` (CI time); auto == always at DP1 stays in `make test`
@pytest.mark.usefixtures("ray_session")
def test_auto_equals_always_at_dp2_with_token_budget(tmp_path) -> None:
    """Two DP shards, rows dealt to the ranks by tokens: the update's log-probs must come back in the
    rollout's row order (else ``token_mult_prob_error`` would leave 1)."""
    data = str(tmp_path / "data")
    extra = ["trainer.n_gpus_per_node=2", "algorithm.ppo_micro_batch_size_per_gpu=4"]
    extra.append("algorithm.ppo_max_token_len_per_gpu=40")
    auto = _run(data, [*extra, f"trainer.default_local_dir={tmp_path / 'auto'}"], use_ray=True)
    always = _run(
        data,
        [*extra, "algorithm.recompute_old_log_probs=always", f"trainer.default_local_dir={tmp_path / 'al'}"],
        use_ray=True,
    )
    _assert_shortcut_taken(auto[0], reference=False)
    _assert_same_run(auto, always)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["algorithm.ppo_epochs=2"], id="two_epochs"),
        pytest.param(["algorithm.ppo_mini_batch_size=4"], id="two_mini_batches"),
    ],
)
def test_auto_keeps_the_pass_for_more_than_one_optimizer_step(tmp_path, extra: list[str]) -> None:
    metrics, _ = _run(
        str(tmp_path / "data"), [*extra, f"trainer.default_local_dir={tmp_path / 'r'}"], steps=1
    )
    _assert_pass_ran(metrics)
    assert metrics[0]["num_optimizer_steps"] == 2
    assert abs(metrics[0]["token_mult_prob_error"] - 1.0) < 1e-5


def test_auto_keeps_the_pass_for_one_step_off(tmp_path) -> None:
    extra = ["trainer.one_step_off=true", f"trainer.default_local_dir={tmp_path / 'r'}"]
    cfg = tiny_run_config(str(tmp_path / "data"), [MIXED_REWARD, *extra])
    tokenizer, loader = _tokenizer_and_loader(cfg)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=4), use_ray=False)
    try:
        with RewardScorer(cfg.reward) as scorer:
            step = GRPOStep(cfg, actors, tokenizer, scorer)
            first, second = loader.next_batch(), loader.next_batch()
            metrics = [step.run(first, 1, next_prompts=second).metrics(), step.run(second, 2).metrics()]
    finally:
        actors.shutdown()
    assert [m["policy_lag"] for m in metrics] == [0.0, 1.0]
    _assert_shortcut_taken(metrics[:1], reference=False)  # step 1's rollout is the current weights'
    _assert_pass_ran(metrics[1:])  # step 2's is one update old: its ratio is not 1
    assert metrics[1]["token_mult_prob_error"] > 1.0 + 1e-4


def test_ppo_with_kl_in_reward_keeps_the_actor_pass(tmp_path) -> None:
    """The in-reward KL reads the actor's log-probs before the update: they come from their own pass."""
    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "critic.ppo_micro_batch_size_per_gpu=8",
            MIXED_REWARD,
            f"trainer.default_local_dir={tmp_path / 'r'}",
        ],
    )
    assert cfg.algorithm.recompute_old_log_probs == "auto"
    tokenizer, loader = _tokenizer_and_loader(cfg)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=4), use_ray=False)
    try:
        critic = build_critic_group(cfg, actors, total_optimizer_steps=4)
        with RewardScorer(cfg.reward) as scorer:
            step = PPOStep(cfg, actors, critic, tokenizer, scorer)
            assert recompute_old_log_probs(cfg.algorithm, step.plan, policy_lag=0)
            batch = step.prepare(loader.next_batch(), step=1)
        mask = batch.rollout.response_mask > 0
        assert torch.isfinite(batch.log_probs.actor_log_probs).all()
        assert (batch.log_probs.actor_log_probs[mask] < 0).all()  # computed, not a placeholder
        assert abs(batch.agreement.token_mult_prob_error - 1.0) < 1e-5
        assert actors.phase_memory()[LOG_PROBS_PHASE] > 0
    finally:
        actors.shutdown()


@pytest.mark.usefixtures("ray_session")
def test_prompt_groups_balanced_over_dp2_equal_the_batch_order(tmp_path, monkeypatch) -> None:
    """``trainer.balance_batch`` (on by default) deals each prompt's samples to the two ranks by tokens: the
    run must equal the batch-order one, and the update's log-probs must come back in the rollout's row
    order (``token_mult_prob_error`` 1)."""
    from mcore_rl.trainer.groups.actor import ActorGroup

    orders: list[list[int] | None] = []
    split = ActorGroup._update_shards

    def recorded(self, batch, plan):  # type: ignore[no-untyped-def]
        shards, order = split(self, batch, plan)
        orders.append(order)
        return shards, order

    monkeypatch.setattr(ActorGroup, "_update_shards", recorded)
    data = str(tmp_path / "data")
    extra = ["trainer.n_gpus_per_node=2", "algorithm.ppo_micro_batch_size_per_gpu=4"]
    balanced = _run(data, [*extra, f"trainer.default_local_dir={tmp_path / 'b'}"], use_ray=True)
    assert len(orders) == 2 and all(o is not None and o != sorted(o) for o in orders), orders
    for order in orders:  # whole groups of rollout.n=4 consecutive rows moved together
        assert order is not None
        assert all(order[i : i + 4] == list(range(order[i], order[i] + 4)) for i in range(0, len(order), 4))
    orders.clear()
    plain = _run(
        data,
        [*extra, "trainer.balance_batch=false", f"trainer.default_local_dir={tmp_path / 'p'}"],
        use_ray=True,
    )
    assert orders == [None, None]
    _assert_shortcut_taken(balanced[0], reference=False)
    _assert_same_run(balanced, plain)
