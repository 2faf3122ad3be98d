"""The RL step on one screen (GRPO and its critic-free kin), driven from a single controller.

    prompts ──► rollout.generate ──► rollout ──┬─► score (rules, on the driver) ─────────┐
      (DP ranks sample                          └─► actors.log_probs (actor, reference) ──┴─► advantages
       different prompts)                             (runs on the workers meanwhile)          (pure)
                                                                                                 │
    next step ◄── rollout.sync (hybrid engine reshard / pool) ◄── actors.update (PPO epochs) ◄──┘

On-policy shortcut (``algorithm.recompute_old_log_probs=auto``, verl's ``on_policy`` branch): when the update
is one optimizer step on a rollout of the current weights, ``actors.log_probs`` runs for the reference alone
(KL loss) or not at all; the update's own forward gives the old log-probs (detached: ratio 1) and the
trainer log-probs of the agreement check.

Every arrow carries a typed record (``mcore_rl/types.py``); each worker call moves whole shards. The
standing health check is NeMo-RL's ``token_mult_prob_error`` between the rollout engine's log-probs and
the trainer's (1.000000 with our engines); above ``logging.token_mult_prob_error_threshold`` it warns with
the worst samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mcore_rl.algo.advantages import compute_advantages
from mcore_rl.algo.agreement import prob_agreement
from mcore_rl.io.errors import note
from mcore_rl.trainer.dynamic_sampling import Sampled, sample_mixed_groups
from mcore_rl.trainer.on_policy import recompute_old_log_probs, training_dropout
from mcore_rl.trainer.step import StageTimer, StepBase
from mcore_rl.types import PromptBatch, RolloutBatch, ScoredBatch, StepStats, TrainBatch


class GRPOStep(StepBase):
    """The critic-free step (``algorithm.adv_estimator`` grpo, dr_grpo, rloo, reinforce_plus_plus[_baseline]);
    see the module docstring."""

    _noted_no_signal = False
    """Set once the all-zero advantages note was given (see :meth:`note_no_signal`)."""

    def run(self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None = None) -> StepStats:
        """One RL step on ``prompts`` (the weights are synced for the next step when it returns).

        ``next_prompts`` (``trainer.one_step_off``): the next step's prompts, generated before this update."""
        cfg, timer = self.cfg, StageTimer()
        rollout, lag = self.rollout_for(prompts, step, next_prompts, timer)
        recompute = recompute_old_log_probs(cfg.algorithm, self.plan, lag, training_dropout(cfg.model))
        sampling: dict[str, float] = {}
        if cfg.algorithm.filter_groups.enable:  # scored first: the groups kept decide the batch
            with timer("sample_groups"):
                rollout, prompts, scored, sampling = self.mixed_groups(rollout, prompts, step)
            with timer("old_log_probs"):
                old_log_probs, ref_log_probs = self.submit_log_probs(rollout, recompute)()
        else:
            with timer("score_and_log_probs"):
                wait_log_probs = self.submit_log_probs(rollout, recompute)
                with timer("score"):
                    scored = self.training_scores(rollout, prompts)
                old_log_probs, ref_log_probs = wait_log_probs()
        advantages = compute_advantages(
            cfg.algorithm.adv_estimator,
            scored.scores,
            rollout.response_mask,
            rollout.prompt_index,
            norm_adv_by_std=cfg.algorithm.norm_by_std,
            gamma=cfg.algorithm.gamma,
        )
        advantages, importance = self.lag_correction(advantages, old_log_probs, rollout, lag)
        self.note_no_signal(advantages, step)
        batch = TrainBatch(
            rollout.tokens,
            rollout.response_mask,
            old_log_probs,
            advantages,
            ref_log_probs,
            rollout.expert_choices,
        )
        wait_update = self.submit_update_for(batch, step, recompute)
        wait_sync = self.submit_sync_and_memory()  # queued behind the update (see StepBase)
        with timer("update"):
            update, trainer_log_probs = wait_update()
        agreement = prob_agreement(rollout.rollout_log_probs, trainer_log_probs, rollout.response_mask)
        self.check_agreement(agreement, rollout, step)
        with timer("sync"):
            synced = wait_sync()
        return self.stats(
            rollout,
            scored,
            agreement,
            update,
            timer,
            synced,
            old_log_probs_recomputed=recompute,
            importance=importance,
            filter_groups=sampling,
        )

    def mixed_groups(
        self, rollout: RolloutBatch, prompts: PromptBatch, step: int
    ) -> tuple[RolloutBatch, PromptBatch, ScoredBatch, dict[str, float]]:
        """``algorithm.filter_groups``: ``data.train_batch_size`` prompt groups whose rewards differ, from this
        rollout and, while short, rollouts of the run's next prompts (``trainer/dynamic_sampling.py``)."""
        draw, attempts = self.draw_prompts, [0]
        if draw is None:
            raise RuntimeError("algorithm.filter_groups: the step was given no data loader (draw_prompts)")

        def more() -> Sampled:
            extra = draw()
            attempts[0] += 1
            batch = self.submit_generate(extra, step, attempt=attempts[0])()
            return Sampled(batch, extra, self.training_scores(batch, extra), self.turns_of(batch))

        cfg = self.cfg
        kept, metrics = sample_mixed_groups(
            Sampled(rollout, prompts, self.training_scores(rollout, prompts), self.turns_of(rollout)),
            more,
            cfg.algorithm.filter_groups,
            cfg.data.train_batch_size,
            cfg.rollout.n,
            self.tokenizer.pad_token_id,
        )
        self._step_turns = kept.turns  # the kept conversations: the step's metrics and logged sample
        return kept.rollout, kept.prompts, kept.scored, metrics

    def note_no_signal(self, advantages: torch.Tensor, step: int) -> None:
        """Say once per run when a step's advantages are all zero: every prompt's samples scored alike (all
        right or all wrong), so the policy-gradient term is zero; a run that stays there learns nothing."""
        if self._noted_no_signal or bool(advantages.abs().amax() > 0):
            return
        self._noted_no_signal = True
        note(
            f"RL step {step}: every advantage is 0 (each prompt's {self.cfg.rollout.n} samples scored alike), "
            "so the step cannot move the policy; if it lasts (mixed_groups stays 0 in metrics.jsonl), check "
            "reward.* against the data's ground truths, or raise rollout.n or rollout.temperature"
        )

    def submit_log_probs(
        self, rollout: RolloutBatch, recompute: bool
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start the forward passes the update needs before it; the result waits for ([N, S] old log-probs,
        [N, S] reference log-probs, zeros without a reference). On the on-policy shortcut only the reference
        runs (when the KL loss reads it) and the old log-probs are NaN: the update computes its own and never
        reads these, and a NaN would make any read fail loudly as a non-finite loss."""
        args = (rollout, self.cfg.rollout.temperature, self.cfg.algorithm.ppo_micro_batch_size_per_gpu)
        if recompute:
            wait = self.actors.submit_log_probs(*args)

            def both() -> tuple[torch.Tensor, torch.Tensor]:
                log_probs = wait()
                return log_probs.actor_log_probs, log_probs.ref_log_probs

            return both
        unread = torch.full(rollout.response_mask.shape, math.nan)
        if not self.loss.use_kl_loss:
            zeros = torch.zeros(rollout.response_mask.shape)
            return lambda: (unread, zeros)
        wait_ref = self.actors.submit_ref_log_probs(*args)
        return lambda: (unread, wait_ref())
