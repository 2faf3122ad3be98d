"""Typed records the RL stages hand each other (driver <-> workers), with their shapes.

Position alignment: every ``[N, S]`` tensor of a batch is indexed by *input position*. Column ``t`` holds
what the logits at position ``t`` are about, i.e. the next token ``tokens[:, t + 1]``: its mask, its rollout
log-prob, its advantage. The first response token of a row with a prompt of length ``p`` is therefore at
column ``p - 1``. Shapes: ``N`` sequences, ``S`` padded prompt + response width, ``T`` max new tokens,
``P`` prompts. All records split by rows (:func:`mcore_rl.controller.dispatch.split_record`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class RolloutRequest:
    """Prompts for one rollout replica (only token ids: answers stay with the driver's scorer)."""

    prompt_ids: list[list[int]]
    """[P][len_p] ragged prompt token ids."""
    prompt_index: Tensor
    """[P] int64: the prompt's number in the step (its GRPO group id)."""


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

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    def responses(self) -> list[list[int]]:
        """Each response's token ids, unpadded."""
        lengths = self.response_lengths.tolist()
        return [row[:n] for row, n in zip(self.response_ids.tolist(), lengths, strict=True)]


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
    """Holds the loss and the logits (the owner of per-sample results when ``tp_rank == 0``)."""
    rollout_replica: int = 0
    """Which rollout engine (group of tp_g ranks) this rank belongs to: its prompt shard."""
    rollout_tp_rank: int = 0
    """Rank within its rollout engine's TP group; rank 0 owns the generated samples."""
