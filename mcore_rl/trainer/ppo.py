"""PPO with a critic (``algorithm.adv_estimator=gae``), HybridFlow's full RL step, on one screen.

    prompts ──► actors.generate ──► rollout ──┬─► score (rules, driver) ──────────────┐
                                               ├─► actors.log_probs (actor, reference) ┼─► token rewards
                                               └─► critic.values ──────────────────────┘   (- beta * KL)
                                                                                               │ GAE (pure)
    next step ◄── rollout.sync ◄── actors.update (after the critic warm-up) ◄── critic.update ◄─┘

Scoring, log-probs and values depend only on the rollout: they are started together and the driver scores
while the workers compute; likewise the critic's and the actor's updates, which read the same batch. With
``algorithm.use_kl_in_reward`` the outcome reward is penalised per token by the KL of the rollout policy to the
reference (``algo/kl_reward.py``; its controller is checkpointed driver state). During the first
``critic.warmup_steps`` steps only the critic learns: the actor is frozen for exactly that many steps (verl's
``critic_warmup=N`` freezes N - 1: it trains the actor from global step N, counted from 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.algo.advantages import compute_gae_advantages, outcome_rewards
from mcore_rl.algo.agreement import ProbAgreement, prob_agreement
from mcore_rl.algo.kl_reward import KLRewardController, penalise
from mcore_rl.config import RunConfig
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.trainer.groups.critic import CriticGroup
from mcore_rl.trainer.groups.reward_model import RewardModelGroup
from mcore_rl.trainer.rollout_source import RolloutSource
from mcore_rl.trainer.step import StageTimer, StepBase, named_nonfinite
from mcore_rl.types import (
    CriticStats,
    LogProbBatch,
    PromptBatch,
    RolloutBatch,
    ScoredBatch,
    StepStats,
    TrainBatch,
    UpdateStats,
    ValueBatch,
)


@dataclass
class PPOBatch:
    """Everything a PPO step computes from one rollout before the updates, position-aligned."""

    rollout: RolloutBatch
    scored: ScoredBatch
    """The scorer's outcome rewards."""
    log_probs: LogProbBatch
    agreement: ProbAgreement
    """Rollout engine vs trainer log-probs."""
    values: torch.Tensor
    """[N, S] float32: the critic's values at rollout time."""
    rewards: torch.Tensor
    """[N, S] float32: token rewards (the score on the last response token, minus the in-reward KL)."""
    advantages: torch.Tensor
    """[N, S] float32: GAE advantages, whitened over the response tokens."""
    returns: torch.Tensor
    """[N, S] float32: GAE returns (raw advantages + values), the critic's targets."""
    kl_in_reward: dict[str, float]
    """kl_in_reward/{coef, mean_kl} with ``use_kl_in_reward``."""
    importance: dict[str, float]
    """rollout_is/* on a lagged rollout."""


class PPOStep(StepBase):
    """The PPO step over an :class:`ActorGroup` and a :class:`CriticGroup` (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        actors: ActorGroup,
        critic: CriticGroup,
        tokenizer: Tokenizer,
        scorer: RewardScorer,
        *,
        rollout: RolloutSource | None = None,
        reward_model: RewardModelGroup | None = None,
    ) -> None:
        super().__init__(cfg, actors, tokenizer, scorer, rollout=rollout, reward_model=reward_model)
        self.critic = critic
        ctrl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = KLRewardController(ctrl) if cfg.algorithm.use_kl_in_reward else None

    def run(self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None = None) -> StepStats:
        timer = StageTimer()
        batch = self.prepare(prompts, step, timer, next_prompts)
        # The two updates read the same batch and write different models: with trainer.overlap_stages the
        # critic's starts first and, on a pool of its own, runs while the actor's does ("critic_update" is then
        # only the wait left after the actor's); else it is awaited before the actor's starts.
        with timer("critic_update"):
            wait_critic = self.critic.submit_update(
                ValueBatch(batch.rollout.tokens, batch.rollout.response_mask, batch.values, batch.returns),
                self.plan.num_mini_batches,
                self.plan.ppo_epochs,
                self.cfg.critic.ppo_micro_batch_size_per_gpu,
            )
            critic_stats = None if self.cfg.trainer.overlap_stages else named_nonfinite(step, wait_critic)
        frozen = step <= self.cfg.critic.warmup_steps
        with timer("update"):
            stats = _frozen_stats() if frozen else self.update(self.train_batch(batch), step)
        with timer("critic_update"):
            critic_stats = named_nonfinite(step, wait_critic) if critic_stats is None else critic_stats
        with timer("sync"):
            synced = self.submit_sync_and_memory()()
        return self.stats(
            batch.rollout,
            batch.scored,
            batch.agreement,
            stats,
            timer,
            synced,
            importance=batch.importance,
            critic=_critic_metrics(critic_stats, batch),
            kl_in_reward=batch.kl_in_reward,
            actor_frozen=frozen,
        )

    def prepare(
        self,
        prompts: PromptBatch,
        step: int,
        timer: StageTimer | None = None,
        next_prompts: PromptBatch | None = None,
    ) -> PPOBatch:
        """Rollout (or the one generated before the last update: ``trainer.one_step_off``), then scores,
        log-probs and values (concurrently), then token rewards and GAE."""
        cfg, timer = self.cfg, timer or StageTimer()
        rollout, lag = self.rollout_for(prompts, step, next_prompts, timer)
        with timer("score_values_and_log_probs"):
            scored, log_probs, values = self.score_values_and_log_probs(rollout, prompts, timer)
        agreement = prob_agreement(
            rollout.rollout_log_probs, log_probs.actor_log_probs, rollout.response_mask
        )
        self.check_agreement(agreement, rollout, step)
        mask = rollout.response_mask
        rewards, kl_metrics = outcome_rewards(scored.scores, mask), {}
        if self.kl_ctrl is not None:
            kl = penalise(
                rewards,
                log_probs.actor_log_probs,
                log_probs.ref_log_probs,
                mask,
                self.kl_ctrl,
                cfg.algorithm.kl_penalty,
            )
            rewards = kl.rewards
            kl_metrics = {"kl_in_reward/coef": kl.kl_coef, "kl_in_reward/mean_kl": kl.mean_kl}
        gae = compute_gae_advantages(rewards, values, mask, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
        # the critic's targets stay unweighted; only the actor's policy gradient is corrected for the lag
        advantages, importance = self.lag_correction(
            gae.advantages.float(), log_probs.actor_log_probs, rollout, lag
        )
        return PPOBatch(
            rollout,
            scored,
            log_probs,
            agreement,
            values,
            rewards,
            advantages,
            gae.returns.float(),
            kl_metrics,
            importance,
        )

    def score_values_and_log_probs(
        self, rollout: RolloutBatch, prompts: PromptBatch, timer: StageTimer
    ) -> tuple[ScoredBatch, LogProbBatch, torch.Tensor]:
        """The three stages that read only the rollout: started together (``trainer.overlap_stages``), or
        each awaited before the next starts; ``timer`` gets ``score`` and, run one by one, the others."""
        cfg, overlap = self.cfg, self.cfg.trainer.overlap_stages
        alone = StageTimer() if overlap else timer  # overlapped stages have no wall time of their own
        with alone("log_probs"):
            wait_log_probs = self.actors.submit_log_probs(
                rollout, cfg.rollout.temperature, cfg.algorithm.ppo_micro_batch_size_per_gpu
            )
            log_probs = None if overlap else wait_log_probs()
        with alone("values"):
            wait_values = self.critic.submit_values(rollout, cfg.critic.ppo_micro_batch_size_per_gpu)
            values = None if overlap else wait_values()
        with timer("score"):
            scored = self.training_scores(rollout, prompts)
        log_probs = wait_log_probs() if log_probs is None else log_probs
        return scored, log_probs, wait_values() if values is None else values

    def train_batch(self, batch: PPOBatch) -> TrainBatch:
        r = batch.rollout
        return TrainBatch(
            r.tokens,
            r.response_mask,
            batch.log_probs.actor_log_probs,
            batch.advantages,
            batch.log_probs.ref_log_probs,
            r.expert_choices,
        )

    def warm_started(self) -> None:
        """The actor changed before RL (SFT): restart the critic's body from it, unless it has its own path."""
        if self.cfg.critic.model_path is None:
            self.critic.init_from_actor()

    def save_models(self, run_checkpoint: str, step: int) -> None:
        self.critic.save(run_checkpoint, step)

    def load_models(self, run_checkpoint: str) -> None:
        self.critic.load(run_checkpoint)

    def close(self) -> None:
        super().close()
        self.critic.shutdown()

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict()} if self.kl_ctrl is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_ctrl is not None:
            if "kl_ctrl" not in state:
                raise ValueError(
                    "algorithm.use_kl_in_reward=true but the checkpoint has no KL controller state"
                )
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])


def _frozen_stats() -> UpdateStats:
    """The actor's stats of a critic warm-up step: no optimizer step was taken."""
    return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, num_optimizer_steps=0, num_skipped=0)


def _critic_metrics(stats: CriticStats, batch: PPOBatch) -> dict[str, float]:
    mask = batch.rollout.response_mask
    tokens = mask.sum().clamp(min=1)
    return {
        **{f"critic/{k}": v for k, v in vars(stats).items()},
        "critic/values_mean": float((batch.values * mask).sum() / tokens),
        "critic/returns_mean": float((batch.returns * mask).sum() / tokens),
    }
