"""What every rollout engine takes and returns, and the protocol it implements.

Two engines implement :class:`RolloutEngine`: :class:`~mcore_rl.engine.rollout.local.LocalRolloutEngine`
(pure PyTorch, any device, the default) and the vLLM engine on GPUs. The driver only sees this module.

Log-prob definition (the quantity the actor recomputes, so that the first PPO ratio is exactly 1)::

    log_probs[i, t] = log_softmax(logits[i, t, :vocab_size] / T)[token_ids[i, t]]

over the *real* vocab (megatron's padding columns excluded), computed on the raw logits BEFORE top-k /
top-p filtering. Filtering changes what can be sampled, not the reported log-probs: the actor cannot
recompute a truncated distribution (verl and vLLM's ``logprobs-mode=raw_logprobs`` report the same). With
``temperature == 0`` sampling is greedy and the log-probs are those of the logits at temperature 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from mcore_rl.io.errors import InputError

FINISH_STOP = "stop"
"""The sequence ended with one of ``SamplingParams.stop_token_ids`` (the stop token is part of the output)."""
FINISH_LENGTH = "length"
"""The sequence reached ``max_new_tokens`` without a stop token."""


class SamplingParamsError(InputError):
    """A sampling parameter out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; one set for every prompt of a ``generate`` call."""

    temperature: float = 1.0
    """Logits are divided by this before softmax; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose cumulative probability first reaches ``top_p``;
    1.0 disables it. Applied after ``top_k``."""
    top_k: int = -1
    """Keep only the ``top_k`` most likely tokens; -1 or 0 disables it."""
    n: int = 1
    """Samples drawn per prompt; outputs hold ``len(prompts) * n`` sequences, prompt-major."""
    max_new_tokens: int = 16
    """Longest response, in tokens (including a final stop token)."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end a sequence (the caller includes EOS here); stored as a tuple. The stop token is
    kept in the output and has a log-prob, like any sampled token."""
    seed: int | None = None
    """Seed of the sampling generator; the same seed, prompts, params and engine configuration give the same
    outputs. None draws one (identical on every TP rank). Give each data-parallel replica its own seed. The
    embedded engine draws for the call's rows in their batch order, so a prompt's samples also depend on the
    other prompts of the call and on the engine's waves (``max_cache_tokens``); vLLM seeds each prompt apart
    (:func:`derived_seed`)."""
    pad_token_id: int = 0
    """Written into ``GenerationOutput.token_ids`` after each sequence's end."""

    def __post_init__(self) -> None:
        # Accept any iterable of ids (lists from YAML) but store a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"
            )
        for name in ("n", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SamplingParamsError(f"{name} must be a positive integer, got {value!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingParamsError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise SamplingParamsError(
                f"pad_token_id must be a non-negative integer, got {self.pad_token_id!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationOutput:
    """``N = len(prompts) * n`` sampled sequences, prompt-major (all samples of prompt 0 first)."""

    prompt_index: Tensor
    """[N] int64: which prompt each sequence continues."""
    token_ids: Tensor
    """[N, max_new_tokens] int64: response tokens, right-padded with ``pad_token_id`` after ``lengths``."""
    log_probs: Tensor
    """[N, max_new_tokens] float32: log-prob of each response token (see the module docstring); 0 at
    padding."""
    lengths: Tensor
    """[N] int64: response tokens per sequence, a final stop token included."""
    finish_reasons: list[str] = field(default_factory=list)
    """[N] ``'stop'`` or ``'length'``."""
    prompt_experts: list[Tensor] | None = None
    """Mixture-of-experts models, when the engine records its routing: per prompt ``j`` (not per sample: the
    ``n`` samples share its prefill) [len_j, L, k] int16, the experts each MoE layer chose for each prompt
    token."""
    response_experts: Tensor | None = None
    """[N, max_new_tokens, L, k] int16 with ``prompt_experts``: the experts chosen for response token ``t`` when
    it was fed back in; -1 where it never was (the last token, padding)."""

    def __post_init__(self) -> None:
        num = self.prompt_index.shape[0]
        for name in ("token_ids", "log_probs"):
            value = getattr(self, name)
            if value.dim() != 2 or value.shape[0] != num:
                raise ValueError(f"{name} must be [N={num}, max_new_tokens], got {tuple(value.shape)}")
        if tuple(self.lengths.shape) != (num,) or len(self.finish_reasons) != num:
            raise ValueError(
                f"lengths {tuple(self.lengths.shape)} and finish_reasons ({len(self.finish_reasons)}) "
                f"must have N={num} entries"
            )

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_index.shape[0])

    def response_mask(self) -> Tensor:
        """[N, max_new_tokens] bool: True on real response tokens."""
        steps = torch.arange(self.token_ids.shape[1], device=self.lengths.device)
        return steps[None, :] < self.lengths[:, None]

    def responses(self) -> list[list[int]]:
        """Each sequence's response tokens as a Python list (unpadded)."""
        return [
            row[:length].tolist() for row, length in zip(self.token_ids, self.lengths.tolist(), strict=True)
        ]


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine in the rollout layout (its own TP group), driven by the hybrid engine.

    Lifecycle per RL step: ``wake_up()`` -> ``load_weights(stream)`` -> ``generate(...)`` (any number) ->
    ``sleep()`` while the actor trains. Every rank of the engine's TP group makes the same calls with the
    same arguments and gets the same outputs.
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` responses for each prompt (lists of token ids, any lengths)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy streamed ``(name, tensor)`` pairs, this rank's shards in the rollout layout, into the engine.
        May be called several times per update (e.g. one bucket at a time)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release memory for training: level 1 frees the KV cache, level 2 also discards the weights
        (``load_weights`` must run again after ``wake_up``)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire memory: ``tags`` among ``'weights'``, ``'kv_cache'``; None = both."""
        ...


@runtime_checkable
class ConversationEngine(Protocol):
    """Token in, token out generation for multi-turn rollouts (``mcore_rl/agent/rollout.py``), beside
    :class:`RolloutEngine`'s ``generate``.

    Each call names its conversations (ids unique within the call) and gives each one's *whole* context: the
    prompt, the model's earlier turns and what tools or environments answered. The engine samples one turn per
    conversation (``params.n`` must be 1) of at most ``max_new_tokens[i]`` tokens (``params.max_new_tokens``
    is not read), ending at a stop id. What it already computed of a context is reused: the embedded engine
    keeps each conversation's KV cache between calls (``rollout/session.py``), vLLM finds it in its prefix
    cache. Reuse never changes a conversation's logits beyond fp32 rounding (a context that does not extend
    what was cached for its id is computed from its first token); the embedded engine's sampled draws follow
    its rows' order, which reuse changes, so a sampled turn is reproducible for the same calls, not across
    cache states.
    """

    def continue_conversations(
        self,
        conversations: Sequence[int],
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int],
    ) -> GenerationOutput:
        """One turn per conversation -> ``GenerationOutput`` in request order (``prompt_index[i] == i``),
        ``token_ids`` [A, max(max_new_tokens)]."""
        ...

    def end_conversations(self) -> None:
        """Forget every conversation (frees the embedded engine's cache; a no-op for vLLM)."""
        ...


def derived_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th part of what ``seed`` draws for (a call's prompt, a conversation, a turn):
    splitmix64 of the pair. vLLM draws sample j of a request from its seed + j, so one seed for every prompt of
    a call gave sample j of each prompt the same draws (a group copied), and ``seed + index`` gave the next
    step's part i the draws of this step's part i + 1 (the step seeds are consecutive); mixed seeds meet
    neither way."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % 2**63


def check_turn_request(
    conversations: Sequence[int],
    contexts: Sequence[Sequence[int]],
    params: SamplingParams,
    max_new_tokens: Sequence[int],
) -> None:
    """What :meth:`ConversationEngine.continue_conversations` refuses, naming the argument."""
    if params.n != 1:
        raise SamplingParamsError(f"continue_conversations samples one turn per conversation: n={params.n}")
    if not len(conversations) == len(contexts) == len(max_new_tokens):
        raise ValueError(
            f"conversations ({len(conversations)}), contexts ({len(contexts)}) and max_new_tokens "
            f"({len(max_new_tokens)}) must have one entry per conversation"
        )
    if len(set(conversations)) != len(conversations):
        raise ValueError("conversations: each id may appear once per call")
    for i, n in enumerate(max_new_tokens):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens[{i}] must be a positive integer, got {n!r}")
