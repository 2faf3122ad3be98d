"""The RL step on one screen (GRPO and its critic-free kin), driven from a single controller.

    prompts ──► actors.generate ──► rollout ──┬─► score (rules, on the driver) ─────────┐
      (DP ranks sample                         └─► actors.log_probs (actor, reference) ──┴─► advantages
       different prompts)                            (runs on the workers meanwhile)          (pure)
                                                                                                │
    next step ◄── actors.sync_weights (hybrid engine reshard) ◄── actors.update (PPO epochs) ◄──┘

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

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from mcore_rl.algo.advantages import compute_advantages
from mcore_rl.algo.agreement import ProbAgreement, prob_agreement, truncated_importance_weights
from mcore_rl.config import AlgorithmConfig, RunConfig
from mcore_rl.controller import WorkerError
from mcore_rl.data.prompts import PromptBatch
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.workers.actor import NonFiniteLossError
from mcore_rl.engine.workers.losses import PolicyLossSettings
from mcore_rl.scoring import RewardScorer, ScoreRequest
from mcore_rl.trainer.groups.actor import ActorGroup, UpdatePlan
from mcore_rl.trainer.groups.reward_model import RewardModelGroup
from mcore_rl.trainer.groups.rollout import RolloutGroup
from mcore_rl.types import RolloutBatch, RolloutRequest, TrainBatch, UpdateStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class StageTimer:
    """Wall seconds per named stage of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class RLStep:
    """The step of the algorithm over an :class:`ActorGroup`, a tokenizer and a reward scorer."""

    def __init__(
        self, cfg: RunConfig, actors: ActorGroup, tokenizer: Tokenizer, scorer: RewardScorer
    ) -> None:
        self.cfg = cfg
        self.actors = actors
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.loss = loss_settings(cfg)
        self.plan = update_plan(cfg)
        self.reward_model: RewardModelGroup | None = None
        """Set by the trainer when ``reward_model.path`` is given: its score joins the rules'."""
        self.rollout_pool: RolloutGroup | None = None
        """Set by the trainer with ``rollout.colocate=false``: rollouts run on this pool, which is sent the
        actor's weights after each update (else the actor's colocated engines, through the hybrid engine)."""
        self._pending: tuple[PromptBatch, Callable[[], RolloutBatch]] | None = None
        """One-step-off: the next step's prompts and their rollout (a wait: on a pool it is still running),
        started before this step's update."""
        self._loading: Callable[[], None] | None = None
        """Rollout pool + one-step-off: the weights sent after the last update, queued behind its generation."""
        self.policy_lag = 0
        """Steps between the weights that generated the last rollout and the actor's when it was trained."""

    def run(
        self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None = None
    ) -> dict[str, float]:
        """One RL step on ``prompts``; returns its metrics (the weights are synced for the next step).

        ``next_prompts`` (``trainer.one_step_off``): the next step's prompts, generated before this update."""
        cfg, timer = self.cfg, StageTimer()
        rollout, lag = self.rollout_for(prompts, step, next_prompts, timer)
        recompute = recompute_old_log_probs(cfg.algorithm, self.plan, lag)
        with timer("score_and_log_probs"):
            wait_log_probs = self.submit_log_probs(rollout, recompute)
            with timer("score"):
                scores = self.training_scores(rollout, prompts)
            old_log_probs, ref_log_probs = wait_log_probs()
        advantages = compute_advantages(
            cfg.algorithm.adv_estimator,
            scores,
            rollout.response_mask,
            rollout.prompt_index,
            norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
            gamma=cfg.algorithm.gamma,
        )
        advantages, is_metrics = self.lag_correction(advantages, old_log_probs, rollout, lag)
        batch = TrainBatch(rollout.tokens, rollout.response_mask, old_log_probs, advantages, ref_log_probs)
        wait_update = self.submit_update_for(batch, step, recompute)
        wait_sync = self.submit_sync_and_memory()
        with timer("update"):
            stats, trainer_log_probs = wait_update()
        agreement = prob_agreement(rollout.rollout_log_probs, trainer_log_probs, rollout.response_mask)
        self.check_agreement(agreement, rollout, step)
        with timer("sync"):
            sync, memory = wait_sync()
        return {
            **step_metrics(rollout, scores, agreement, stats, timer.seconds, cfg.rollout.n),
            "old_log_probs_recomputed": float(recompute),
            **sync,
            **memory,
            **self.lag_metrics(lag),
            **is_metrics,
        }

    def lag_correction(
        self, advantages: torch.Tensor, old_log_probs: torch.Tensor, rollout: RolloutBatch, lag: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages of a lagged rollout times truncated importance weights
        (``algorithm.rollout_is_threshold``), and their metrics; on-policy rollouts come back unchanged.

        Weighting the advantage is verl's TIS exactly: for a weight w >= 0 PPO's per-token loss satisfies
        ``l(w * A, ratio) = w * l(A, ratio)`` (clip and dual-clip choices depend on the sign of A only), so the
        policy-gradient term is weighted and the KL and entropy terms are not."""
        threshold = self.cfg.algorithm.rollout_is_threshold
        if lag == 0 or threshold is None:
            return advantages, {}
        mask = rollout.response_mask
        tis = truncated_importance_weights(old_log_probs, rollout.rollout_log_probs, mask, threshold)
        return advantages * tis.weights, tis.metrics

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

    def submit_update_for(
        self, batch: TrainBatch, step: int, recompute: bool
    ) -> Callable[[], tuple[UpdateStats, torch.Tensor]]:
        """Start the actor update; the result waits for its stats and the [N, S] trainer log-probs of the
        rollout before it: the recomputed old log-probs, or on the shortcut those of the update's own forward.
        A NaN/inf loss stops the run naming the step (nothing was applied)."""
        if recompute:
            wait = self.actors.submit_update(batch, self.loss, self.plan)
            return lambda: (_named_nonfinite(step, wait), batch.old_log_probs)
        wait_on_policy = self.actors.submit_update_on_policy(batch, self.loss, self.plan)

        def collect() -> tuple[UpdateStats, torch.Tensor]:
            result = _named_nonfinite(step, wait_on_policy)
            return result.stats, result.actor_log_probs

        return collect

    def submit_sync_and_memory(self) -> Callable[[], tuple[dict[str, float], dict[str, float]]]:
        """Start the weight sync of :meth:`sync_rollout` and then the read of the step's memory peaks (per
        phase, max over ranks); the result waits for both. Colocated engines sync right behind the update,
        which is submitted first: an actor runs its calls in order, so no driver round trip separates them.
        A rollout pool's sync starts when awaited."""
        if self.rollout_pool is not None:
            return lambda: (self.sync_rollout(), self.actors.phase_memory())
        sync, memory = self.actors.submit_sync_weights(), self.actors.submit_phase_memory()
        return lambda: (sync(), memory())

    def rollout_for(
        self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None, timer: StageTimer
    ) -> tuple[RolloutBatch, int]:
        """This step's rollout and its policy lag in steps: generated now (0), or by the previous step before
        its update (1). With ``next_prompts`` the next step's rollout is generated now, before the update."""
        if self._pending is not None and self._pending[0] is prompts:
            with timer("generate_wait"):  # a rollout pool may still be sampling it
                rollout, lag = self._pending[1](), 1
        else:
            with timer("generate"):
                rollout, lag = self.generate(prompts, step), 0
        self._pending, self.policy_lag = None, lag
        if next_prompts is not None:
            with timer("generate_next"):  # on a rollout pool only started: it samples during the update
                self._pending = (next_prompts, _once(self.submit_generate(next_prompts, step + 1)))
        return rollout, lag

    def pending_rollout(self, prompts: PromptBatch | None) -> RolloutBatch | None:
        """The rollout generated ahead for ``prompts`` (one-step-off), for run checkpoints."""
        if prompts is None or self._pending is None or self._pending[0] is not prompts:
            return None
        return self._pending[1]()

    def restore_pending(self, prompts: PromptBatch, rollout: RolloutBatch) -> None:
        """Resume: ``rollout`` was generated for ``prompts`` by the weights before the checkpointed update."""
        self._pending = (prompts, lambda: rollout)

    def generate(self, prompts: PromptBatch, step: int) -> RolloutBatch:
        return self.submit_generate(prompts, step)()

    def submit_generate(self, prompts: PromptBatch, step: int) -> Callable[[], RolloutBatch]:
        """Start sampling ``prompts``; the result waits for the rollout. Colocated engines sample now."""
        request = RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts)))
        if self.rollout_pool is not None:
            return self.rollout_pool.submit_generate(request, self.sampling(step))
        rollout = self.actors.generate(request, self.sampling(step))
        return lambda: rollout

    def sync_rollout(self) -> dict[str, float]:
        """The updated actor weights to the rollout engines: the hybrid engine's reshard into the colocated
        ones, or sent to the rollout pool. With a generation pending there, the load queues behind it (a pool
        worker runs calls in order) and the driver goes on; it is awaited at the next sync."""
        if self.rollout_pool is None:
            return self.actors.sync_weights()
        start = time.perf_counter()
        if self._loading is not None:
            self._loading()
        waited = time.perf_counter()
        # actor rank 0 gathers; its result goes to the pool as an object ref, not through the driver
        loading, self._loading = self.rollout_pool.submit_load_weights_from(self.actors), None
        if self._pending is None:
            loading()  # the next step generates right away, from these weights
        else:
            self._loading = loading
        return {"time/sync_wait_last_s": waited - start, "time/sync_send_s": time.perf_counter() - waited}

    def lag_metrics(self, lag: int) -> dict[str, float]:
        """``policy_lag`` with ``trainer.one_step_off`` (on-policy runs log exactly what they did before)."""
        return {"policy_lag": float(lag)} if self.cfg.trainer.one_step_off else {}

    def warm_started(self) -> None:
        """Called once the actor has changed before RL (the SFT warm start); the PPO step restarts its critic."""

    def state_dict(self) -> dict[str, Any]:
        """Driver state of the algorithm for run checkpoints (none here; PPO keeps its KL controller)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def save_models(self, run_checkpoint: str, step: int) -> None:
        """Models of the algorithm beside the actor (PPO's critic) into the run checkpoint; none here."""

    def load_models(self, run_checkpoint: str) -> None:
        """Restore :meth:`save_models`."""

    def close(self) -> None:
        """Stop worker groups of the algorithm beside the actor's (a rollout or critic pool)."""
        if self.rollout_pool is not None:
            self.rollout_pool.shutdown()

    def update(self, batch: TrainBatch, step: int) -> UpdateStats:
        """The actor update; a NaN/inf loss stops the run naming the step (nothing was applied)."""
        stats, _ = self.submit_update_for(batch, step, recompute=True)()
        return stats

    def sampling(self, step: int, validation: bool = False) -> SamplingParams:
        seed = self.cfg.trainer.seed * 1_000_003 + step
        tok = self.tokenizer
        return self.cfg.rollout.sampling_params(tok.eos_token_id, tok.pad_token_id, seed, validation)

    def score(self, rollout: RolloutBatch, prompts: PromptBatch) -> torch.Tensor:
        """[N] rewards of the decoded responses; the ground truths never leave the driver."""
        index = rollout.prompt_index.tolist()
        texts = [self.tokenizer.decode(r) for r in rollout.responses()]
        requests = [
            ScoreRequest(prompts.data_sources[i], text, prompts.ground_truths[i], prompts.extra_infos[i])
            for i, text in zip(index, texts, strict=True)
        ]
        return self.scorer.score(requests).scores.float()

    def training_scores(self, rollout: RolloutBatch, prompts: PromptBatch) -> torch.Tensor:
        """[N] the step's reward: the rules', or ``rule_weight * rules + weight * model`` with a reward
        model (started first, so that it scores on the workers while the driver runs the rules)."""
        if self.reward_model is None:
            return self.score(rollout, prompts)
        rm = self.cfg.reward_model
        wait = self.reward_model.submit_scores(rollout, rm.micro_batch_size_per_gpu)
        rules = self.score(rollout, prompts)
        return rm.rule_weight * rules + rm.weight * wait().float()

    def evaluate(self, prompts: PromptBatch) -> float:
        """Mean validation reward (accuracy for 0/1 rules) with ``rollout.val_kwargs`` sampling."""
        # Repeat the last prompt so that every rollout replica gets as many; the extras are not scored.
        extra = -len(prompts) % self.actors.num_rollout_shards
        ids = prompts.prompt_ids + [prompts.prompt_ids[-1]] * extra
        request = RolloutRequest(ids, torch.arange(len(ids)))
        self.actors.sync_weights()
        rollout = self.actors.generate(request, self.sampling(0, validation=True))
        keep = rollout.prompt_index < len(prompts)
        scores = self.score(_rows(rollout, keep), prompts)
        self.actors.phase_memory()  # validation's phases are not the next step's
        return float(scores.mean())

    def check_agreement(self, agreement: ProbAgreement, rollout: RolloutBatch, step: int) -> None:
        threshold = self.cfg.logging.token_mult_prob_error_threshold
        if agreement.token_mult_prob_error <= threshold:
            return
        worst = ", ".join(
            f"row {row} (prompt {int(rollout.prompt_index[row])}, {value:.4f})"
            for row, value in agreement.worst(3)
        )
        log.warning(
            "step %d: token_mult_prob_error %.6f > %.3f: rollout and trainer log-probs disagree; worst: %s",
            step,
            agreement.token_mult_prob_error,
            threshold,
            worst,
        )


def _named_nonfinite(step: int, update: Callable[[], T]) -> T:
    """Run ``update``; its NaN/inf-loss error (nothing was applied) comes back naming the step."""
    try:
        return update()
    except (NonFiniteLossError, WorkerError) as err:
        if "NaN/inf loss" not in str(err):
            raise
        raise NonFiniteLossError(
            f"step {step}: NaN/inf loss, the update was not applied (trainer.on_nonfinite_loss=skip "
            f"skips such updates): {str(err).splitlines()[0][:300]}"
        ) from err


def recompute_old_log_probs(algo: AlgorithmConfig, plan: UpdatePlan, policy_lag: int) -> bool:
    """Whether the step runs the actor's old-log-prob pass (``algorithm.recompute_old_log_probs``). auto
    skips it only where it provably equals the update's own forward: one optimizer step (one epoch, one
    mini-batch) on a rollout of the weights being updated (policy lag 0), and no in-reward KL reading the
    actor's log-probs before the update."""
    mode = algo.recompute_old_log_probs
    if mode not in ("auto", "always"):
        raise ValueError(f"algorithm.recompute_old_log_probs={mode!r}: choose auto or always")
    one_step = plan.ppo_epochs == 1 and plan.num_mini_batches == 1
    on_policy = one_step and policy_lag == 0 and not algo.use_kl_in_reward
    return mode == "always" or not on_policy


def _once(wait: Callable[[], T]) -> Callable[[], T]:
    """``wait`` that runs once and then returns the same result (a pending rollout is read twice when a run
    checkpoint saves it)."""
    result: list[T] = []

    def first() -> T:
        if not result:
            result.append(wait())
        return result[0]

    return first


def _rows(rollout: RolloutBatch, keep: torch.Tensor) -> RolloutBatch:
    """The rows of ``rollout`` where ``keep`` [N] is True."""
    return RolloutBatch(*(getattr(rollout, f)[keep] for f in RolloutBatch.__dataclass_fields__))


def loss_settings(cfg: RunConfig) -> PolicyLossSettings:
    """The actor loss from ``algorithm`` (Dr.GRPO takes its seq-mean-token-sum-norm aggregation)."""
    algo = cfg.algorithm
    dr_grpo = algo.adv_estimator == "dr_grpo"
    return PolicyLossSettings(
        vocab_size=cfg.model.arch().vocab_size,
        temperature=cfg.rollout.temperature,
        clip_ratio_low=algo.clip_ratio_low,
        clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c,
        loss_agg_mode="seq-mean-token-sum-norm" if dr_grpo else algo.loss_agg_mode,
        norm_constant=float(cfg.rollout.response_length),
        use_kl_loss=algo.use_kl_loss,
        kl_loss_coef=algo.kl_loss_coef,
        kl_loss_type=algo.kl_loss_type,
        entropy_coeff=algo.entropy_coeff,
    )


def update_plan(cfg: RunConfig) -> UpdatePlan:
    algo = cfg.algorithm
    if cfg.data.train_batch_size % algo.ppo_mini_batch_size:
        raise ValueError(
            f"algorithm.ppo_mini_batch_size={algo.ppo_mini_batch_size} must divide "
            f"data.train_batch_size={cfg.data.train_batch_size}"
        )
    return UpdatePlan(
        num_mini_batches=cfg.data.train_batch_size // algo.ppo_mini_batch_size,
        ppo_epochs=algo.ppo_epochs,
        micro_batch_size=algo.ppo_micro_batch_size_per_gpu,
        on_nonfinite=cfg.trainer.on_nonfinite_loss,
        token_budget=algo.ppo_max_token_len_per_gpu,
    )


def step_metrics(
    rollout: RolloutBatch,
    scores: torch.Tensor,
    agreement: ProbAgreement,
    stats: UpdateStats,
    seconds: dict[str, float],
    n: int,
) -> dict[str, Any]:
    """The step's metrics: rewards, lengths, agreement, update stats, timings, throughput."""
    groups = scores.view(-1, n)
    mixed = (groups != groups[:, :1]).any(dim=1).float().mean()
    tokens = int(rollout.response_lengths.sum())
    nested = ("score", "log_probs", "values")  # inside score_and_log_probs / score_values_and_log_probs
    step_s = sum(v for k, v in seconds.items() if k not in nested)
    return {
        "reward": float(scores.mean()),
        "mixed_groups": float(mixed),
        "response_len": float(rollout.response_lengths.float().mean()),
        "token_mult_prob_error": agreement.token_mult_prob_error,
        **vars(stats),
        **{f"time/{k}_s": v for k, v in seconds.items()},
        "time/step_s": step_s,
        # one-step-off: this step generated the next rollout, of about as many tokens
        "tokens_per_s": tokens / max(seconds.get("generate", 0.0) or seconds.get("generate_next", 0.0), 1e-9),
    }
