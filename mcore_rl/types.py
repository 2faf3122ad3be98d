"""Typed records the RL stages hand each other (driver <-> workers), with their shapes.

Position alignment: every ``[N, S]`` tensor of a batch is indexed by *input position*. Column ``t`` holds
what the logits at position ``t`` are about, i.e. the next token ``tokens[:, t + 1]``: its mask, its rollout
log-prob, its advantage. The first response token of a row with a prompt of length ``p`` is therefore at
column ``p - 1``. Shapes: ``N`` sequences, ``S`` padded prompt + response width, ``T`` max new tokens,
``P`` prompts. All records split by rows (:func:`mcore_rl.controller.dispatch.split_record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class PromptBatch:
    """B prompts of one step (or one validation call)."""

    prompt_ids: list[list[int]]
    """[B][len_b] ragged token ids, as the rollout engine takes them."""
    indices: Tensor
    """[B] int64: position of each prompt in its dataset."""
    data_sources: list[str] = field(default_factory=list)
    """[B]"""
    ground_truths: list[Any] = field(default_factory=list)
    """[B]"""
    extra_infos: list[dict[str, Any]] = field(default_factory=list)
    """[B]"""
    origins: list[str] = field(default_factory=list)
    """[B] ``file row N`` of each prompt, for messages (e.g. ``ScoreRequest.where``)."""
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    """[B][m_b] each prompt as its dataset row's chat messages (``{"role", "content", ...}``; a plain-text prompt
    as one ``user`` message): the opening of a multi-turn conversation as its environment, tools and logged
    record read it. The model reads ``prompt_ids`` (the chat template's rendering), never these. Empty: not
    known (a batch built from token ids alone)."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def padded(self, pad_token_id: int) -> tuple[Tensor, Tensor]:
        """Right-padded ``(tokens [B, S] int64, lengths [B] int64)`` with ``S`` the longest prompt."""
        lengths = torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.long)
        width = int(lengths.max()) if len(self) else 0
        tokens = torch.full((len(self), width), pad_token_id, dtype=torch.long)
        for i, ids in enumerate(self.prompt_ids):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return tokens, lengths

    def shard(self, rank: int, num_ranks: int) -> PromptBatch:
        """The contiguous ``rank``-th of ``num_ranks`` equal parts (a data-parallel replica's prompts)."""
        if len(self) % num_ranks:
            raise ValueError(f"{len(self)} prompts do not split into {num_ranks} equal parts")
        size = len(self) // num_ranks
        return self.part(slice(rank * size, (rank + 1) * size))

    def part(self, rows: slice) -> PromptBatch:
        """The prompts of ``rows``."""
        return PromptBatch(
            self.prompt_ids[rows],
            self.indices[rows],
            self.data_sources[rows],
            self.ground_truths[rows],
            self.extra_infos[rows],
            self.origins[rows],
            self.messages[rows],
        )

    def parts(self, size: int | None) -> list[PromptBatch]:
        """Consecutive parts of at most ``size`` prompts (None: the whole batch as one)."""
        size = size or max(len(self), 1)
        return [self.part(slice(i, i + size)) for i in range(0, len(self), size)]


@dataclass
class RolloutRequest:
    """Prompts for one rollout replica (only token ids: answers stay with the driver's scorer)."""

    prompt_ids: list[list[int]]
    """[P][len_p] ragged prompt token ids."""
    prompt_index: Tensor
    """[P] int64: the prompt's number in the step (its GRPO group id)."""


@dataclass
class TurnRequest:
    """One turn of a rollout replica's open conversations (multi-turn rollouts: token in, token out)."""

    conversations: list[int]
    """[M] the conversations' ids (their rows in the rollout)."""
    contexts: list[list[int]]
    """[M][len_m] each conversation's whole context: prompt, earlier turns, tool answers."""
    max_new_tokens: list[int]
    """[M] the most tokens each may sample this turn (what is left of its response budget)."""


@dataclass
class RolloutBatch:
    """Sampled sequences, prompt-major (the ``n`` samples of a prompt are adjacent), position-aligned."""

    tokens: Tensor
    """[N, S] int64: prompt + response, right-padded with the pad id."""
    response_mask: Tensor
    """[N, S] float32: 1 on the positions that predict a response token (stop token included)."""
    rollout_log_probs: Tensor
    """[N, S] float32: the sampling policy's log-prob of the next token, 0 off the mask."""
    response_ids: Tensor
    """[N, T] int64: the response tokens alone, right-padded (for decoding and scoring)."""
    response_lengths: Tensor
    """[N] int64: response tokens per sequence."""
    prompt_index: Tensor
    """[N] int64: the prompt (group) each sequence continues."""
    expert_choices: Tensor | None = None
    """[N, S, L, k] int16, mixture-of-experts models (the embedded engine): the ``k`` experts each of the
    ``L`` MoE layers routed the token at each position to while sampling (column ``t`` = the routing of
    ``tokens[:, t]``); -1 where nothing was routed (padding, a response's last token). None: not recorded.
    Read by the routing-agreement metric and router replay (``engine/moe.py``)."""

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    def responses(self) -> list[list[int]]:
        """Each response's token ids, unpadded."""
        lengths = self.response_lengths.tolist()
        return [row[:n] for row, n in zip(self.response_ids.tolist(), lengths, strict=True)]


@dataclass
class SFTBatch:
    """Right-padded next-token training rows of supervised fine-tuning."""

    tokens: Tensor
    """[B, S] int64: prompt + response + EOS, then padding."""
    labels: Tensor
    """[B, S] int64: ``tokens`` shifted left by one (the token each position predicts)."""
    loss_mask: Tensor
    """[B, S] float32: 1 on positions predicting a response token or EOS."""


@dataclass
class LogProbBatch:
    """Log-probs the trainer recomputes on a rollout batch, position-aligned like it."""

    actor_log_probs: Tensor
    """[N, S] float32: the actor's log-prob of the next token (at the rollout temperature)."""
    entropy: Tensor
    """[N, S] float32: the actor's entropy at each position."""
    ref_log_probs: Tensor
    """[N, S] float32: the reference policy's log-prob; zeros when there is no reference."""


@dataclass
class TrainBatch:
    """What one actor update consumes, position-aligned."""

    tokens: Tensor
    """[N, S] int64."""
    response_mask: Tensor
    """[N, S] float32."""
    old_log_probs: Tensor
    """[N, S] float32: behaviour-policy log-probs, the denominator of the PPO ratio."""
    advantages: Tensor
    """[N, S] float32."""
    ref_log_probs: Tensor
    """[N, S] float32: for the KL loss term; zeros when unused."""
    expert_choices: Tensor | None = None
    """[N, S, L, k] int16: the rollout's routing (``RolloutBatch.expert_choices``); None when not recorded."""


@dataclass(frozen=True)
class UpdateStats:
    """One actor update (all mini-batches and epochs of a step), reduced over data-parallel ranks."""

    pg_loss: float
    """Policy loss, mean over the optimizer steps (each the global mini-batch loss)."""
    kl_loss: float
    """KL-to-reference loss term before its coefficient (0 without it)."""
    entropy: float
    """Token-mean entropy of the actor on the response tokens."""
    clip_frac: float
    """Fraction of response tokens whose PPO ratio was clipped (token-weighted)."""
    clip_frac_lower: float
    """Fraction of response tokens the dual clip bounded (negative advantage, ratio past ``clip_ratio_c``)."""
    approx_kl: float
    """Token-mean ``old_log_prob - log_prob`` (k1 KL estimate of the update's drift)."""
    grad_norm: float
    """Gradient norm before clipping, mean over optimizer steps."""
    lr: float
    """Learning rate of the last optimizer step."""
    num_optimizer_steps: int
    """Optimizer steps taken (mini-batches x epochs), skipped ones excluded."""
    num_skipped: int
    """Updates skipped because the loss was NaN/inf (``on_nonfinite_loss=skip``)."""
    moe_load_balancing_loss: float | None = None
    """Mixture-of-experts models: megatron's load-balancing loss before its coefficient (1.0 = tokens spread
    evenly), mean over the optimizer steps and MoE layers; None when it is off."""
    moe_z_loss: float | None = None
    """Mixture-of-experts models: the router z-loss before its coefficient; None when it is off."""
    moe_router_agreement: float | None = None
    """Mixture-of-experts models: the fraction of (token, MoE layer) pairs whose top-k experts in the update's
    first forward (the weights that sampled the rollout, before any step) equal the rollout engine's; with
    router replay on, the trainer's own choice is compared before it is replaced. None: no recorded routing."""


@dataclass
class OnPolicyUpdate:
    """An update of one optimizer step whose old log-probs are its own forward's, detached (verl's on-policy
    shortcut, ``algorithm.recompute_old_log_probs=auto``): its stats and what that forward computed."""

    stats: UpdateStats
    actor_log_probs: Tensor
    """[N, S] float32: the actor's log-prob of the next token before the step (the weights that generated the
    rollout), 0 off the response mask; rows in the update batch's order (owner ranks only)."""


@dataclass(frozen=True)
class RankInfo:
    """Where one worker sits in the training layout and in the rollout layout."""

    rank: int
    """Global torch.distributed rank."""
    dp_rank: int
    """Training data-parallel rank: which train shard this rank consumes."""
    tp_rank: int
    """Training tensor-parallel rank."""
    pp_rank: int
    """Training pipeline stage."""
    is_last_stage: bool
    """Holds the loss and the logits (the owner of per-sample results when ``tp_rank == 0`` and
    ``cp_rank == 0``)."""
    rollout_replica: int = 0
    """Which rollout engine (group of tp_g ranks) this rank belongs to: its prompt shard."""
    rollout_tp_rank: int = 0
    """Rank within its rollout engine's TP group; rank 0 owns the generated samples."""
    cp_rank: int = 0
    """Training context-parallel rank: CP ranks of one DP shard read the same rows and hold the same results."""


@dataclass
class ValueBatch:
    """What one critic update consumes, position-aligned like :class:`~mcore_rl.types.TrainBatch`."""

    tokens: Tensor
    """[N, S] int64."""
    response_mask: Tensor
    """[N, S] float32."""
    old_values: Tensor
    """[N, S] float32: the critic's values at rollout time (the centre of the value clip)."""
    returns: Tensor
    """[N, S] float32: GAE returns (advantages + values), 0 off the mask."""


@dataclass(frozen=True)
class CriticStats:
    """One critic update (all mini-batches and epochs of a step), reduced over data-parallel ranks."""

    vf_loss: float
    """Clipped value loss, mean over the optimizer steps."""
    vf_clip_frac: float
    """Fraction of response tokens where the clipped error was the larger (token-weighted)."""
    vpred_mean: float
    """Token-mean predicted value on the response."""
    grad_norm: float
    """Critic gradient norm before clipping, mean over optimizer steps."""
    lr: float
    """Critic learning rate of the last optimizer step."""
    num_skipped: int = 0
    """Critic updates skipped for a NaN/inf loss or gradient (``on_nonfinite_loss=skip``); the means above
    are over the others."""


@dataclass
class ScoredBatch:
    """A rollout's rewards, in its row order, with what the scorers reported beside them."""

    scores: Tensor
    """[N] float32: the step's reward of each response (the rules', or ``reward_model.rule_weight * rules +
    reward_model.weight * model`` with a reward model)."""
    rule_scores: Tensor
    """[N] float32: the rule (or user) scorers' part, 0 where a scorer failed or timed out."""
    model_scores: Tensor | None = None
    """[N] float32: the reward model's part; None without one."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """Scorer-named extra metrics of dict-returning scorers, name -> [N] float32, NaN where absent."""
    num_errors: int = 0
    """Answers whose scorer raised (scored 0 under ``reward.on_error=zero``)."""
    num_nonfinite: int = 0
    """Answers scored NaN or infinite (scored 0)."""
    num_timeouts: int = 0
    """Answers past ``reward.timeout_s`` (scored 0)."""
    overlong_penalty: Tensor | None = None
    """[N] float32 (<= 0): DAPO's overlong punishment, included in ``scores`` (``reward.overlong_buffer``)."""

    def metrics(self) -> dict[str, float]:
        """The scorer's counts and the mean of each extra over the rows that have it."""
        out = {
            "reward/scorer_errors": float(self.num_errors),
            "reward/scorer_nonfinite": float(self.num_nonfinite),
            "reward/scorer_timeouts": float(self.num_timeouts),
        }
        if self.model_scores is not None:
            out["reward/rules"] = float(self.rule_scores.mean())
            out["reward/model"] = float(self.model_scores.mean())
        if self.overlong_penalty is not None:
            out["reward/overlong_penalty"] = float(self.overlong_penalty.mean())
            out["reward/overlong_frac"] = float((self.overlong_penalty < 0).float().mean())
        for name, values in self.extras.items():
            present = values[~torch.isnan(values)]
            if present.numel():
                out[f"reward_extra/{name}"] = float(present.mean())
        return out


@dataclass(frozen=True)
class StepStats:
    """What one RL step reports: one ``rl`` record of ``metrics.jsonl`` once flattened by :meth:`metrics`.

    Stage timings and memory peaks are keyed by stage and phase (their names are the step's, not a schema's);
    everything else is a field."""

    reward: float
    """Mean of the step's reward over the responses."""
    mixed_groups: float
    """Fraction of prompts whose ``rollout.n`` responses did not all score the same (the ones with signal)."""
    response_len: float
    """Mean response tokens."""
    response_clip_ratio: float
    """Fraction of responses cut at ``rollout.response_length`` (verl's ``response_length/clip_ratio``)."""
    token_mult_prob_error: float
    """Rollout engine vs trainer log-probs on the response tokens (``algo/agreement.py``)."""
    update: UpdateStats
    """The actor's update."""
    seconds: dict[str, float]
    """Wall seconds per stage (generate, score_and_log_probs, update, sync, ...)."""
    tokens_per_s: float | None
    """The rollout's response tokens per wall second of its sampling (one-step-off: the previous step's
    sampling of this rollout; a rollout pool's, until its samples reached the driver); None where unknown
    (the first rollout after a resume was sampled before the checkpoint)."""
    scorer: dict[str, float]
    """:meth:`ScoredBatch.metrics`: the scorer's error and timeout counts, its extra metrics."""
    sync: dict[str, float]
    """The weight sync's timings (``time/sync_*_s``) and, colocated, the rollout phase's memory."""
    memory: dict[str, float]
    """Peak memory per phase since the last step, the maximum over ranks (``memory/*``)."""
    old_log_probs_recomputed: bool | None = None
    """Whether the actor's old-log-prob pass ran (critic-free steps; PPO always runs it)."""
    policy_lag: int | None = None
    """Steps between the weights that sampled the rollout and the actor trained (``trainer.one_step_off``)."""
    importance: dict[str, float] = field(default_factory=dict)
    """``rollout_is/*`` of a lagged rollout's truncated importance weights."""
    critic: dict[str, float] = field(default_factory=dict)
    """PPO: ``critic/*`` (its update stats, values and returns means)."""
    kl_in_reward: dict[str, float] = field(default_factory=dict)
    """``kl_in_reward/{coef, mean_kl}`` with ``algorithm.use_kl_in_reward``."""
    actor_frozen: bool | None = None
    """PPO: the actor did not train this step (``critic.warmup_steps``)."""
    multi_turn: dict[str, float] = field(default_factory=dict)
    """``multi_turn/*`` of a multi-turn rollout: turns and tool calls per sample, errors, timeouts, how the
    conversations ended, model vs tool tokens (``agent/records.py``)."""
    filter_groups: dict[str, float] = field(default_factory=dict)
    """``filter_groups/*`` of DAPO's dynamic sampling: rollouts sampled, the share of groups kept."""

    @property
    def step_s(self) -> float:
        """The step's wall seconds: its stages, less those nested inside another (score within
        score_and_log_probs, ...)."""
        nested = ("score", "log_probs", "values")
        return sum(v for k, v in self.seconds.items() if k not in nested)

    def metrics(self) -> dict[str, float]:
        """The flat record the run log writes."""
        out: dict[str, float] = {
            "reward": self.reward,
            "mixed_groups": self.mixed_groups,
            "response_len": self.response_len,
            "response_clip_ratio": self.response_clip_ratio,
            "token_mult_prob_error": self.token_mult_prob_error,
            **{k: v for k, v in vars(self.update).items() if v is not None},
            **{f"time/{k}_s": v for k, v in self.seconds.items()},
            "time/step_s": self.step_s,
            **({} if self.tokens_per_s is None else {"tokens_per_s": self.tokens_per_s}),
            **self.scorer,
            **self.critic,
            **self.kl_in_reward,
            **self.importance,
            **self.multi_turn,
            **self.filter_groups,
        }
        if self.old_log_probs_recomputed is not None:
            out["old_log_probs_recomputed"] = float(self.old_log_probs_recomputed)
        if self.actor_frozen is not None:
            out["actor_frozen"] = float(self.actor_frozen)
        out.update(self.sync)
        out.update(self.memory)
        if self.policy_lag is not None:
            out["policy_lag"] = float(self.policy_lag)
        return out
