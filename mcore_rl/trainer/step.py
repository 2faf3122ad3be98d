"""What every RL step shares (GRPO and its critic-free kin in ``grpo.py``, PPO in ``ppo.py``): the rollout,
its scores, the actor update, the weight sync and validation, each over typed records (``mcore_rl/types.py``).

    prompts ──► rollout.submit_generate ──► RolloutBatch ──► score ──► ScoredBatch
                         ▲                       │
                         │                       └──► (the algorithm: log-probs, values, advantages)
                         │                                                    │
      rollout.submit_sync_and_memory ◄── actors.update(TrainBatch) ◄─────────┘   ──► StepStats

The rollout source (``rollout_source.py``: the actor's own engines or a pool) and the reward model are given
at construction; with ``trainer.one_step_off`` the next step's rollout is started before this step's update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from mcore_rl.algo.agreement import ProbAgreement, truncated_importance_weights
from mcore_rl.config import RunConfig
from mcore_rl.controller import WorkerError
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.train_engine import NonFiniteLossError
from mcore_rl.engine.workers.losses import PolicyLossSettings
from mcore_rl.scoring import RewardScorer, ScoreRequest
from mcore_rl.scoring.shaping import overlong_penalty
from mcore_rl.trainer.groups.actor import ActorGroup, UpdatePlan
from mcore_rl.trainer.groups.reward_model import RewardModelGroup
from mcore_rl.trainer.multi_turn import MultiTurnOutput, TurnsAhead, build_multi_turn, conversation_samples
from mcore_rl.trainer.rollout_source import ColocatedRollout, RolloutSource
from mcore_rl.trainer.validation import Evaluation, generation_samples, scored_parts
from mcore_rl.types import (
    PromptBatch,
    RolloutBatch,
    RolloutRequest,
    ScoredBatch,
    StepStats,
    TrainBatch,
    UpdateStats,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_Pending = tuple[
    PromptBatch, Callable[[], RolloutBatch], Callable[[], float | None], Callable[[], MultiTurnOutput | None]
]
"""A rollout generated ahead (one-step-off): its prompts, the wait for it, the seconds it took to sample, and
the wait for a multi-turn rollout's conversations (what its scores and metrics read)."""


class StageTimer:
    """Wall seconds per named stage of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class StepBase:
    """The parts of an RL step over an :class:`ActorGroup` that do not depend on the algorithm."""

    def __init__(
        self,
        cfg: RunConfig,
        actors: ActorGroup,
        tokenizer: Tokenizer,
        scorer: RewardScorer,
        *,
        rollout: RolloutSource | None = None,
        reward_model: RewardModelGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.actors = actors
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.rollout = rollout or ColocatedRollout(actors)
        """Where rollouts are sampled and how the updated weights reach the engines."""
        self.reward_model = reward_model
        """With ``reward_model.path``: its score joins the rules' (``reward_model.weight``)."""
        self.loss = loss_settings(cfg)
        self.plan = update_plan(cfg)
        self._model_stops = cfg.model.generation_stop_ids()
        """The model's own stop ids (``generation_config.json``), where the tokenizer names one EOS."""
        self._pending: _Pending | None = None
        """One-step-off: the next step's prompts and their rollout (a wait: on a pool it is still running),
        started before this step's update."""
        self._generation_s: float | None = None
        """Wall seconds this step's rollout took to sample (None: unknown, a rollout restored on resume)."""
        self.policy_lag = 0
        """Steps between the weights that generated the last rollout and the actor's when it was trained."""
        self._val_samples: list[dict[str, Any]] = []
        """``logging.log_val_generations``: samples of the validations since :meth:`take_val_samples` (and with
        multi-turn rollouts, every ``rollout.multi_turn.log_conversation_freq`` steps, one conversation)."""
        self.multi_turn = build_multi_turn(cfg, tokenizer)
        """``rollout.multi_turn.enable``: the agent loop that samples every rollout turn by turn; None: one
        response per sample."""
        self.last_turns: MultiTurnOutput | None = None
        """The conversations of the last multi-turn rollout sampled (a step's, the next step's generated ahead,
        or a validation's)."""
        self._step_turns: MultiTurnOutput | None = None
        """The conversations of this step's own rollout (with one-step-off, sampled the step before)."""
        self._step = 0
        self.draw_prompts: Callable[[], PromptBatch] | None = None
        """The run's next prompts (its data loader), for ``algorithm.filter_groups``."""

    def run(self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None = None) -> StepStats:
        """One RL step on ``prompts``; the weights are synced for the next step when it returns.
        ``next_prompts`` (``trainer.one_step_off``): the next step's prompts, generated before this update."""
        raise NotImplementedError

    # --- rollout --------------------------------------------------------------------------------------------
    def rollout_for(
        self, prompts: PromptBatch, step: int, next_prompts: PromptBatch | None, timer: StageTimer
    ) -> tuple[RolloutBatch, int]:
        """This step's rollout and its policy lag in steps: generated now (0), or by the previous step before
        its update (1). With ``next_prompts`` the next step's rollout is generated now, before the update."""
        self._step = step
        if self._pending is not None and self._pending[0] is prompts:
            with timer("generate_wait"):  # a rollout pool may still be sampling it
                rollout, lag = self._pending[1](), 1
            self._generation_s, self._step_turns = self._pending[2](), self._pending[3]()
        else:
            with timer("generate"):
                rollout, lag = self.submit_generate(prompts, step)(), 0
            self._generation_s, self._step_turns = timer.seconds["generate"], self.last_turns
        self._pending, self.policy_lag = None, lag
        if next_prompts is not None:
            self._pending = self._generate_ahead(next_prompts, step + 1, timer)
        return rollout, lag

    def _generate_ahead(self, prompts: PromptBatch, step: int, timer: StageTimer) -> _Pending:
        """One-step-off: start the next step's rollout; with it, how to tell how long it took to sample.
        The colocated engines sample within the call; a rollout pool only starts there and samples during the
        update, so its seconds run until the samples reached the driver. A multi-turn rollout on a pool is
        driven from a thread of the driver meanwhile (``TurnsAhead``)."""
        started = time.perf_counter()
        if self.multi_turn is not None and not isinstance(self.rollout, ColocatedRollout):
            ahead = TurnsAhead(lambda: self._sample_turns(prompts, self.sampling(step)))
            return prompts, lambda: ahead.turns().batch, lambda: ahead.seconds, ahead.turns
        with timer("generate_next"):
            wait = _once(self.submit_generate(prompts, step))
        if isinstance(self.rollout, ColocatedRollout):
            sampled, turns = time.perf_counter() - started, self.last_turns if self.multi_turn else None
            return prompts, wait, lambda: sampled, lambda: turns
        done: list[float] = []  # the seconds until the samples first reached the driver

        def received() -> RolloutBatch:
            batch = wait()
            if not done:
                done.append(time.perf_counter() - started)
            return batch

        return prompts, received, lambda: done[0], lambda: None  # read after ``received``

    def submit_generate(
        self, prompts: PromptBatch, step: int, attempt: int = 0
    ) -> Callable[[], RolloutBatch]:
        """Start sampling ``prompts``; the result waits for the rollout. Colocated engines sample now.
        ``attempt``: a further rollout of the same step (dynamic sampling), drawn from other seeds."""
        params = self.sampling(step)
        if attempt:  # one step's seeds apart from any other step's (steps < 1e9)
            params = dataclasses.replace(params, seed=(params.seed or 0) + attempt * 1_000_000_007)
        if self.multi_turn is not None:  # driven turn by turn from here: done when it returns
            self.last_turns = self._sample_turns(prompts, params)
            batch = self.last_turns.batch
            return lambda: batch
        request = RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts)))
        return self.rollout.submit_generate(request, params)

    def _sample_turns(self, prompts: PromptBatch, params: SamplingParams) -> MultiTurnOutput:
        """A multi-turn rollout of ``prompts``, its conversations driven turn by turn from the driver."""
        assert self.multi_turn is not None
        return self.multi_turn.run(self.rollout.turns(len(prompts) * params.n), prompts, params)

    def pending_rollout(self, prompts: PromptBatch | None) -> RolloutBatch | None:
        """The rollout generated ahead for ``prompts`` (one-step-off), for run checkpoints."""
        if prompts is None or self._pending is None or self._pending[0] is not prompts:
            return None
        return self._pending[1]()

    def pending_turns(self, prompts: PromptBatch | None) -> MultiTurnOutput | None:
        """The conversations of the multi-turn rollout generated ahead for ``prompts``, for run checkpoints."""
        if prompts is None or self._pending is None or self._pending[0] is not prompts:
            return None
        return self._pending[3]()

    def restore_pending(
        self, prompts: PromptBatch, rollout: RolloutBatch, turns: MultiTurnOutput | None = None
    ) -> None:
        """Resume: ``rollout`` (a multi-turn one with its ``turns``) was generated for ``prompts`` by the weights
        before the checkpointed update."""
        self._pending = (prompts, lambda: rollout, lambda: None, lambda: turns)

    def sampling(self, step: int, validation: bool = False) -> SamplingParams:
        seed = self.cfg.trainer.seed * 1_000_003 + step
        tok = self.tokenizer
        return self.cfg.rollout.sampling_params(
            tok.eos_token_id, tok.pad_token_id, seed, validation, self._model_stops
        )

    # --- scores ---------------------------------------------------------------------------------------------
    def turns_of(self, rollout: RolloutBatch) -> MultiTurnOutput | None:
        """The conversations ``rollout`` was built from: this step's multi-turn rollout or the last sampled."""
        for turns in (self._step_turns, self.last_turns):
            if turns is not None and turns.batch is rollout:
                return turns
        return None

    def score(
        self, rollout: RolloutBatch, prompts: PromptBatch, turns: MultiTurnOutput | None = None
    ) -> ScoredBatch:
        """The rules' rewards of the decoded responses; the ground truths never leave the driver. A multi-turn
        rollout's (``turns``): the rules read ``rollout.multi_turn.score_text``, and the rewards its tools and
        environment returned are added."""
        index = rollout.prompt_index.tolist()
        turns = turns if turns is not None else self.turns_of(rollout)
        if turns is not None:
            texts = turns.score_texts
        else:
            texts = [self.tokenizer.decode(r) for r in rollout.responses()]
        requests = [
            ScoreRequest(prompts.data_sources[i], text, prompts.ground_truths[i], prompts.extra_infos[i])
            for i, text in zip(index, texts, strict=True)
        ]
        out = self.scorer.score(requests)
        rules = out.scores.float()
        return ScoredBatch(
            scores=rules if turns is None else rules + turns.tool_rewards,
            rule_scores=rules,
            extras=dict(out.extra),
            num_errors=out.num_errors,
            num_nonfinite=out.num_nonfinite,
            num_timeouts=out.num_timeouts,
        )

    def training_scores(self, rollout: RolloutBatch, prompts: PromptBatch) -> ScoredBatch:
        """The step's reward: the rules', or ``rule_weight * rules + weight * model`` with a reward model
        (started first, so that it scores on the workers while the driver runs the rules); a multi-turn
        rollout's tool and environment rewards added to either, unweighted; then ``reward.overlong_buffer``."""
        if self.reward_model is None:
            return self._shaped(self.score(rollout, prompts), rollout)
        rm = self.cfg.reward_model
        wait = self.reward_model.submit_scores(rollout, rm.micro_batch_size_per_gpu)
        scored = self.score(rollout, prompts)
        model = wait().float()
        scores = rm.rule_weight * scored.rule_scores + rm.weight * model
        turns = self.turns_of(rollout)
        scored.scores = scores if turns is None else scores + turns.tool_rewards
        scored.model_scores = model
        return self._shaped(scored, rollout)

    def _shaped(self, scored: ScoredBatch, rollout: RolloutBatch) -> ScoredBatch:
        """``reward.overlong_buffer``: DAPO's overlong punishment added to the training rewards."""
        buffer = self.cfg.reward.overlong_buffer
        if buffer.enable:
            lengths, budget = rollout.response_lengths, self.cfg.rollout.response_length
            scored.overlong_penalty = overlong_penalty(lengths, budget, buffer.len, buffer.penalty_factor)
            scored.scores = scored.scores + scored.overlong_penalty
        return scored

    def evaluate(self, prompts: PromptBatch) -> Evaluation:
        """Accuracy and mean reward of ``prompts`` with ``rollout.val_kwargs`` sampling, on the actor's own engines, ``data.val_batch_size`` prompts per generate call (each call its own seed); the first
        ``logging.log_val_generations`` prompts' samples are kept for :meth:`take_val_samples`."""
        sampling, scores = self.sampling(0, validation=True), []
        keep = self.cfg.logging.log_val_generations
        for part, scored in scored_parts(self, prompts, self.cfg.data.val_batch_size, sampling):
            scores.append(scored.scores)
            if keep > 0:
                samples = generation_samples(self.tokenizer, part, scored, keep)
                self._val_samples += samples
                keep -= len(samples)
        return Evaluation.of(torch.cat(scores))

    def take_val_samples(self) -> list[dict[str, Any]]:
        """The validation samples kept since the last call; the run log writes them with the record that
        follows the validation (``generations.jsonl``)."""
        samples, self._val_samples = self._val_samples, []
        return samples

    # --- the update and what follows ------------------------------------------------------------------------
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

    def submit_update_for(
        self, batch: TrainBatch, step: int, recompute: bool
    ) -> Callable[[], tuple[UpdateStats, torch.Tensor]]:
        """Start the actor update; the result waits for its stats and the [N, S] trainer log-probs of the
        rollout before it: the recomputed old log-probs, or on the shortcut those of the update's own forward.
        A NaN/inf loss stops the run naming the step (nothing was applied)."""
        if recompute:
            wait = self.actors.submit_update(batch, self.loss, self.plan)
            return lambda: (named_nonfinite(step, wait), batch.old_log_probs)
        wait_on_policy = self.actors.submit_update_on_policy(batch, self.loss, self.plan)

        def collect() -> tuple[UpdateStats, torch.Tensor]:
            result = named_nonfinite(step, wait_on_policy)
            return result.stats, result.actor_log_probs

        return collect

    def update(self, batch: TrainBatch, step: int) -> UpdateStats:
        """The actor update, awaited (old log-probs recomputed); a NaN/inf loss stops the run naming the step."""
        stats, _ = self.submit_update_for(batch, step, recompute=True)()
        return stats

    def submit_sync_and_memory(self) -> Callable[[], tuple[dict[str, float], dict[str, float]]]:
        """Start the weight sync to the rollout engines and then the read of the step's memory peaks. The sync
        must be submitted after the update it follows: both sources rely on a rank running its calls in
        submission order (``rollout_source.py``). Conversations sampled ahead end first: the weights must not
        change under their later turns."""
        pending = self._pending
        wait = self.rollout.submit_sync_and_memory(generation_pending=pending is not None)
        if pending is None or self.multi_turn is None:
            return wait
        return lambda: (pending[1](), wait())[1]

    def check_agreement(self, agreement: ProbAgreement, rollout: RolloutBatch, step: int) -> None:
        threshold = self.cfg.logging.token_mult_prob_error_threshold
        if agreement.token_mult_prob_error <= threshold:
            return
        worst = ", ".join(
            f"row {row} (prompt {int(rollout.prompt_index[row])}, {value:.4f})"
            for row, value in agreement.worst(3)
        )
        lag = (
            " (trainer.one_step_off: one update's policy change included)"
            if self.cfg.trainer.one_step_off
            else ""
        )
        log.warning(
            "step %d: token_mult_prob_error %.6f > %.3f: rollout and trainer log-probs disagree%s; worst: %s",
            step,
            agreement.token_mult_prob_error,
            threshold,
            lag,
            worst,
        )

    def stats(
        self,
        rollout: RolloutBatch,
        scored: ScoredBatch,
        agreement: ProbAgreement,
        update: UpdateStats,
        timer: StageTimer,
        sync_and_memory: tuple[dict[str, float], dict[str, float]],
        **algorithm: Any,
    ) -> StepStats:
        """The step's record: the rollout's figures (mean reward, prompts with mixed rewards, response length,
        generation throughput) with the algorithm's own fields (``algorithm``: see :class:`StepStats`)."""
        groups = scored.scores.view(-1, self.cfg.rollout.n)
        turns = self.turns_of(rollout)
        if turns is not None:
            self._sample_conversation(turns, scored)
        tokens = int(rollout.response_lengths.sum())
        generate_s = self._generation_s
        return StepStats(
            reward=float(scored.scores.mean()),
            mixed_groups=float((groups != groups[:, :1]).any(dim=1).float().mean()),
            response_len=float(rollout.response_lengths.float().mean()),
            response_clip_ratio=float(
                (rollout.response_lengths >= self.cfg.rollout.response_length).float().mean()
            ),
            token_mult_prob_error=agreement.token_mult_prob_error,
            update=update,
            seconds=timer.seconds,
            tokens_per_s=None if generate_s is None else tokens / max(generate_s, 1e-9),
            scorer=scored.metrics(),
            sync=sync_and_memory[0],
            memory=sync_and_memory[1],
            policy_lag=self.policy_lag if self.cfg.trainer.one_step_off else None,
            multi_turn={} if turns is None else turns.metrics(),
            **algorithm,
        )

    def _sample_conversation(self, turns: MultiTurnOutput, scored: ScoredBatch) -> None:
        """Every ``rollout.multi_turn.log_conversation_freq`` steps, the step's first conversation for the run
        log's ``generations.jsonl`` (written with this step's record)."""
        freq = self.cfg.rollout.multi_turn.log_conversation_freq
        if freq and self._step % freq == 0:
            self._val_samples += conversation_samples(self.tokenizer, turns, scored.scores, 1)

    # --- hooks of the run around the step -------------------------------------------------------------------
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
        """Stop worker groups of the step beside the actor's (a rollout pool; PPO's critic pool) and the tool
        workers of multi-turn rollouts."""
        if self.multi_turn is not None:
            self.multi_turn.executor.close()
        self.rollout.close()


def named_nonfinite(step: int, update: Callable[[], T]) -> T:
    """Run ``update``; its NaN/inf-loss error (nothing was applied) comes back naming the step. The error is
    recognised by type, in-process or from a Ray worker (``WorkerError.cause``)."""
    try:
        return update()
    except NonFiniteLossError as err:
        raise _step_nonfinite(step, err) from err
    except WorkerError as err:
        if not isinstance(err.cause, NonFiniteLossError):
            raise
        raise _step_nonfinite(step, err) from err


def _step_nonfinite(step: int, err: Exception) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"step {step}: NaN/inf loss or gradient, the update was not applied (trainer.on_nonfinite_loss=skip "
        f"skips such updates): {str(err).splitlines()[0][:300]}"
    )


def _once(wait: Callable[[], T]) -> Callable[[], T]:
    """``wait`` that runs once and then returns the same result (a pending rollout is read twice when a run
    checkpoint saves it)."""
    result: list[T] = []

    def first() -> T:
        if not result:
            result.append(wait())
        return result[0]

    return first


def loss_settings(cfg: RunConfig) -> PolicyLossSettings:
    """The actor loss from ``algorithm`` (Dr.GRPO's aggregation is settled by its config section)."""
    algo = cfg.algorithm
    return PolicyLossSettings(
        vocab_size=cfg.model.arch().vocab_size,
        temperature=cfg.rollout.temperature,
        loss_mode=algo.policy_loss,
        clip_ratio_low=algo.clip_range[0],
        clip_ratio_high=algo.clip_range[1],
        clip_ratio_c=algo.clip_ratio_c,
        loss_agg_mode=algo.aggregation,
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
        balance_group_size=cfg.rollout.n if cfg.trainer.balance_batch else None,
    )
