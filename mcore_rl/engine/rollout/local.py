"""The embedded rollout engine: batched, KV-cached sampling with :class:`RolloutDecoder`, on any device.

One ``generate`` call::

    prompts (B lists of ids)
      -> waves of prompts, each sized so that B_w * n * (longest prompt + max_new_tokens) cache slots fit
      -> prefill: left-padded prompts, once per prompt (chunks of at most ``max_prefill_tokens``)
      -> copy each prompt's cache rows n times (n samples share one prefill)
      -> loop: sample (same generator on every TP rank) -> record -> drop finished rows (every
         ``stop_check_interval`` steps) -> decode one token
      -> GenerationOutput, prompt-major

Finished rows leave the batch at the next check (their cache rows are compacted away), so the decode cost
follows the number of live sequences. The loop has no per-sequence Python work: everything is a batched
tensor op. The KV cache is allocated once and kept while the engine is awake (``sleep`` frees it): waves and
calls reuse it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mcore_rl.compat import megatron_cpu
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    SamplingParams,
    check_turn_request,
)
from mcore_rl.engine.rollout.decoder import RolloutDecoder
from mcore_rl.engine.rollout.kv_cache import KVCache
from mcore_rl.engine.rollout.sampling import sample_tokens
from mcore_rl.engine.rollout.session import ConversationCache

_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class LocalRolloutConfig:
    """Settings of :class:`LocalRolloutEngine` (sampling settings travel with each call instead)."""

    dtype: torch.dtype = torch.float32
    """Weights, activations and KV cache dtype (logits and log-probs are always fp32)."""
    max_cache_tokens: int = 1 << 18
    """KV-cache slots held at once: sequences x (longest prompt + max_new_tokens). Prompts that do not fit
    run in successive waves."""
    max_prefill_tokens: int = 1 << 14
    """Padded prompt tokens per prefill forward; bounds the [rows, heads, len, len] attention scores."""
    stop_check_interval: int | None = None
    """Decode steps between checks for sequences that hit a stop token (a device-to-host sync), which then
    leave the batch. Between checks finished rows keep decoding, their outputs masked; outputs are
    deterministic for a given value. None: 1 on CPU (the check is free, dropping rows at once saves
    compute), 8 on accelerators (a sync per step would stall the device queue behind Python)."""

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {self.dtype}"
            )
        for name in ("max_cache_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        interval = self.stop_check_interval
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f"stop_check_interval must be a positive integer or None, got {interval!r}")


@dataclass
class _Outputs:
    """The call's output buffers, filled row by row as sequences finish."""

    token_ids: Tensor  # [N, max_new] int64, pre-filled with the pad id
    log_probs: Tensor  # [N, max_new] fp32, zeros
    lengths: Tensor  # [N] int64, max_new until a stop token says otherwise
    stopped: Tensor  # [N] bool
    prompt_experts: list[Tensor] | None = None  # MoE routing records (``record_routing``), per prompt
    response_experts: Tensor | None = None  # [N, max_new, L, k] int16, -1 where nothing was routed


class LocalRolloutEngine:
    """Pure-PyTorch :class:`~mcore_rl.engine.rollout.base.RolloutEngine` over its own TP group.

    Every rank of ``tp_group`` (None: unsharded) holds its rollout-layout shard and makes the same calls.
    """

    def __init__(
        self,
        arch: ModelArch,
        config: LocalRolloutConfig | None = None,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.arch = arch
        self.config = config or LocalRolloutConfig()
        self.tp_group = tp_group
        self.device = torch.device(device)
        self.decoder = RolloutDecoder(arch, tp_group, self.device, self.config.dtype)
        self._loaded: set[str] = set()
        self._asleep: set[str] = set()
        self._weights_released = False
        self._cache: KVCache | None = None
        self._conversations = ConversationCache(self.decoder, self.config.dtype, self.device)
        """Multi-turn rollouts: each conversation's KV cache between turns (``continue_conversations``)."""
        self.prefill_routing: Tensor | None = None
        """[prompts, width, L, k] int16: the last prefill's routing (MoE models, while recording)."""
        self.record_routing = arch.moe is not None
        """Mixture-of-experts models: ``generate`` returns the experts each token was routed to
        (``GenerationOutput.prompt_experts`` / ``response_experts``), for router replay and the routing-agreement
        metric."""

    # --- lifecycle -----------------------------------------------------------------------------------------
    @property
    def asleep(self) -> frozenset[str]:
        """Which of 'weights', 'kv_cache' are released (or offloaded) right now."""
        return frozenset(self._asleep)

    def missing_weights(self) -> list[str]:
        """Rollout-layout names never loaded since the weights were (re)allocated."""
        return sorted(set(self.decoder.shapes) - self._loaded)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        if "weights" in self._asleep:
            raise RuntimeError("load_weights() while the weights are asleep; call wake_up() first")
        self._conversations.clear()  # keys and values of the old weights
        for name, tensor in named_tensors:
            self.decoder.load(name, tensor)
            self._loaded.add(name)

    def sleep(self, level: int = 1) -> None:
        """Level 1: the KV cache is freed and the weights move to host memory (kept); level 2: the weights
        are discarded too."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._cache = None
        self._conversations.clear()
        if level == 2:
            self.decoder.release()
            self._loaded.clear()
            self._weights_released = True
        elif self.device.type != "cpu" and not self._weights_released:
            self.decoder.to("cpu")
        self._asleep.update(_TAGS)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = list(_TAGS if tags is None else tags)
        unknown = set(tags) - set(_TAGS)
        if unknown:
            raise ValueError(f"tags must be among {_TAGS}, got {sorted(unknown)}")
        if "weights" in tags and "weights" in self._asleep:
            if self._weights_released:
                self.decoder.allocate()  # zeros: load_weights must follow
                self._weights_released = False
            else:
                self.decoder.to(self.device)
        self._asleep.difference_update(tags)

    def _check_ready(self) -> None:
        if self._asleep:
            raise RuntimeError(f"generate() while {sorted(self._asleep)} asleep; call wake_up() first")
        missing = self.missing_weights()
        if missing:
            raise RuntimeError(f"{len(missing)} weights were never loaded, e.g. {missing[:3]}")

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if min(prompt) < 0 or max(prompt) >= self.arch.vocab_size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, vocab_size={self.arch.vocab_size})")

    def _resolve_seed(self, seed: int | None) -> int:
        """The call's seed; a drawn one comes from TP rank 0 so that every rank samples alike."""
        if seed is not None:
            return seed
        value = torch.randint(0, 2**62, (1,))
        if self.tp_group is not None:
            dist.broadcast(value, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return int(value)

    # --- generation ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    @megatron_cpu.suspended()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """``params.n`` sampled responses per prompt; tensors of the result are on the CPU. Runs outside
        megatron's CPU compatibility mode (it calls no megatron code, and the mode taxes every torch call)."""
        self._check_ready()
        self._check_prompts(prompts)
        n, max_new = params.n, params.max_new_tokens
        num = len(prompts) * n
        out = _Outputs(
            token_ids=torch.full((num, max_new), params.pad_token_id, dtype=torch.long, device=self.device),
            log_probs=torch.zeros(num, max_new, dtype=torch.float32, device=self.device),
            lengths=torch.full((num,), max_new, dtype=torch.long, device=self.device),
            stopped=torch.zeros(num, dtype=torch.bool, device=self.device),
        )
        if self.record_routing and self.arch.moe is not None:
            moe = self.arch.moe
            out.prompt_experts = [torch.empty(0)] * len(prompts)
            shape = (num, max_new, len(moe.layers), moe.top_k)
            out.response_experts = torch.full(shape, -1, dtype=torch.int16, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self._resolve_seed(params.seed))
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        for first, last in self._waves(prompts, params):
            self._run_wave(prompts[first:last], first * n, params, stop_ids, generator, out)
        _finish(out, stop_ids)
        return GenerationOutput(
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            token_ids=out.token_ids.cpu(),
            log_probs=out.log_probs.cpu(),
            lengths=out.lengths.cpu(),
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in out.stopped.tolist()],
            prompt_experts=out.prompt_experts,
            response_experts=None if out.response_experts is None else out.response_experts.cpu(),
        )

    @torch.inference_mode()
    @megatron_cpu.suspended()
    def continue_conversations(
        self,
        conversations: Sequence[int],
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int],
    ) -> GenerationOutput:
        """Token in, token out: one turn of each conversation from its whole context (the protocol:
        ``base.ConversationEngine``), reusing each one's KV cache of the last call where its context extends
        what was cached (``session.py``), so a multi-turn rollout's next turn computes only the tool's answer.
        Conversations that do not fit ``max_cache_tokens`` together run in waves (the last wave's stay
        cached)."""
        self._check_ready()
        self._check_prompts(contexts)
        check_turn_request(conversations, contexts, params, max_new_tokens)
        generator = torch.Generator(device=self.device).manual_seed(self._resolve_seed(params.seed))
        num, width = len(contexts), max(max_new_tokens, default=1)
        token_ids = torch.full((num, width), params.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(num, width)
        lengths = torch.zeros(num, dtype=torch.long)
        stopped = torch.zeros(num, dtype=torch.bool)
        interval = self._stop_check_interval()
        for first, last in self._turn_waves(conversations, contexts, max_new_tokens):
            part = slice(first, last)
            out = self._conversations.turn(
                conversations[part], contexts[part], max_new_tokens[part], params, generator, interval
            )
            token_ids[part, : out.token_ids.shape[1]] = out.token_ids.cpu()
            log_probs[part, : out.log_probs.shape[1]] = out.log_probs.cpu()
            lengths[part], stopped[part] = out.lengths.cpu(), out.stopped.cpu()
        return GenerationOutput(
            prompt_index=torch.arange(num),
            token_ids=token_ids,
            log_probs=log_probs,
            lengths=lengths,
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()],
        )

    def end_conversations(self) -> None:
        """Free the conversations' KV cache (a rollout is complete)."""
        self._conversations.clear()

    def _turn_waves(
        self, ids: Sequence[int], contexts: Sequence[Sequence[int]], max_new: Sequence[int]
    ) -> list[tuple[int, int]]:
        """[first, last) request ranges whose turn fits ``max_cache_tokens`` (at least one each): rows x
        (longest cached part + longest new part + longest turn), the columns a turn's aligned rows span."""
        reuse = self._conversations.plan_reuse(ids, contexts)
        waves, first = [], 0
        cached = new = longest = 0
        for i, context in enumerate(contexts):
            grown = (max(cached, reuse[i]), max(new, len(context) - reuse[i]), max(longest, max_new[i]))
            if i > first and (i - first + 1) * sum(grown) > self.config.max_cache_tokens:
                waves.append((first, i))
                first, grown = i, (reuse[i], len(context) - reuse[i], max_new[i])
            cached, new, longest = grown
        if contexts:
            waves.append((first, len(contexts)))
        return waves

    def _waves(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[tuple[int, int]]:
        """[first, last) prompt ranges whose n samples fit ``max_cache_tokens`` together (at least one)."""
        if not prompts:
            return []
        per_sequence = max(len(p) for p in prompts) + params.max_new_tokens
        per_wave = max(1, self.config.max_cache_tokens // (per_sequence * params.n))
        return [(i, min(i + per_wave, len(prompts))) for i in range(0, len(prompts), per_wave)]

    def _cache_for(self, rows: int, max_len: int) -> KVCache:
        """A KV cache of at least ``rows`` x ``max_len`` slots: the one kept from earlier waves and calls when
        it is large enough (see ``KVCache``: stale contents are never read), else a new one, grown in both
        dimensions at once unless that would exceed ``max_cache_tokens``. Allocating per call costs more
        than the copies it avoids: fresh pages fault in as the zeros are written."""
        if self._cache is not None:
            if self._cache.rows >= rows and self._cache.max_len >= max_len:
                return self._cache
            grown = max(rows, self._cache.rows), max(max_len, self._cache.max_len)
            if grown[0] * grown[1] <= self.config.max_cache_tokens:
                rows, max_len = grown
            self._cache = None  # free the old buffers before allocating the new ones
        arch = self.arch
        self._cache = KVCache.allocate(
            arch.num_layers,
            rows,
            self.decoder.num_kv_heads,
            max_len,
            arch.head_dim,
            self.config.dtype,
            self.device,
        )
        return self._cache

    def _prefill(
        self, prompts: Sequence[Sequence[int]], width: int, cache: KVCache
    ) -> tuple[Tensor, Tensor | None]:
        """A wave's prompts, left-padded to ``width``, into cache rows [0, B) -> (fp32 logits [B, vocab] of
        their last tokens, left padding [B] or None when all prompts have the same length)."""
        lengths = [len(p) for p in prompts]
        pad = (
            None if min(lengths) == width else torch.tensor([width - n for n in lengths], device=self.device)
        )
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = torch.as_tensor(prompt)
        tokens = tokens.to(self.device)
        per_chunk = max(1, self.config.max_prefill_tokens // width)
        logits: list[Tensor] = []
        routing: list[Tensor] = []
        for i in range(0, len(prompts), per_chunk):
            rows = slice(i, min(i + per_chunk, len(prompts)))
            with _routing_of(self.decoder, routing, (rows.stop - rows.start, width)):
                logits.append(
                    self.decoder.prefill(tokens[rows], None if pad is None else pad[rows], cache, rows)
                )
        self.prefill_routing = torch.cat(routing) if routing else None
        return torch.cat(logits), pad

    def _run_wave(
        self,
        prompts: Sequence[Sequence[int]],
        first_row: int,
        params: SamplingParams,
        stop_ids: Tensor,
        generator: torch.Generator,
        out: _Outputs,
    ) -> None:
        """Generate every sample of ``prompts`` into output rows ``first_row...``."""
        n, max_new = params.n, params.max_new_tokens
        width = max(len(p) for p in prompts)
        num = len(prompts) * n
        cache = self._cache_for(num, width + max_new)
        self.decoder.routing = None
        logits, pad = (
            self._prefill(prompts, width, cache)
            if out.prompt_experts is None
            else self._recorded_prefill(prompts, width, cache, first_row // n, out)
        )
        if n > 1:
            cache.repeat_rows(len(prompts), n, width)
            logits = logits.repeat_interleave(n, 0)
            pad = None if pad is None else pad.repeat_interleave(n)
        # output row of each cache row: a slice until finished rows leave the batch
        rows: Tensor | slice = slice(first_row, first_row + num)
        running: Tensor | None = None  # [rows] bool: still running; None until stop ids were checked
        interval = self._stop_check_interval()
        self.decoder.start_decoding(num)
        for step in range(max_new):
            tokens, log_probs = sample_tokens(logits, params, generator)
            running = _record(out, rows, running, step, tokens, log_probs, stop_ids, params.pad_token_id)
            if step + 1 == max_new:
                return
            if running is not None and (step + 1) % interval == 0:
                if bool(running.all()):  # the loop's only host sync
                    running = None
                else:
                    keep = torch.nonzero(running).squeeze(1)
                    if keep.numel() == 0:
                        return
                    cache.keep_rows(keep, width + step)  # only the columns written so far move
                    if isinstance(rows, slice):
                        rows = torch.arange(rows.start, rows.stop, device=self.device)
                    rows, tokens = rows[keep], tokens[keep]
                    pad = None if pad is None else pad[keep]
                    running = None
            if out.response_experts is None:
                logits = self.decoder.decode(tokens, width + step, pad, cache)
                continue
            routing: list[Tensor] = []
            with _routing_of(self.decoder, routing, (tokens.shape[0], 1)):
                logits = self.decoder.decode(tokens, width + step, pad, cache)
            out.response_experts[rows, step] = routing[0][:, 0].to(torch.int16)  # token ``step`` as input

    def _recorded_prefill(
        self, prompts: Sequence[Sequence[int]], width: int, cache: KVCache, first_prompt: int, out: _Outputs
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`_prefill`, keeping each prompt's routing (its last ``len`` columns: prompts are left-padded)."""
        logits, pad = self._prefill(prompts, width, cache)
        assert out.prompt_experts is not None and self.prefill_routing is not None
        for row, prompt in enumerate(prompts):
            out.prompt_experts[first_prompt + row] = self.prefill_routing[row, width - len(prompt) :].cpu()
        return logits, pad

    def _stop_check_interval(self) -> int:
        interval = self.config.stop_check_interval
        if interval is not None:
            return interval
        return 1 if self.device.type == "cpu" else 8


@contextlib.contextmanager
def _routing_of(decoder: RolloutDecoder, sink: list[Tensor], shape: tuple[int, int]) -> Iterator[None]:
    """While the block runs a forward of ``shape`` = [b, s] tokens, the decoder's MoE layers record their
    choices; afterwards ``sink`` gets them as one [b, s, L, k] int16 tensor (nothing for a dense model)."""
    if decoder.arch.moe is None:
        yield
        return
    decoder.routing = []
    try:
        yield
        layers = [choices.view(*shape, -1) for choices in decoder.routing]  # each [b * s, k]
        sink.append(torch.stack(layers, dim=2).to(torch.int16))
    finally:
        decoder.routing = None


def _record(
    out: _Outputs,
    rows: Tensor | slice,
    running: Tensor | None,
    step: int,
    tokens: Tensor,
    log_probs: Tensor,
    stop_ids: Tensor,
    pad_id: int,
) -> Tensor | None:
    """Writes the batch's ``step`` into output ``rows`` (a slice while they are still the wave's first ones in
    order) -> which rows still run after it (None: no stop ids). Rows that stopped earlier stay in the batch
    until the next check (``stop_check_interval``) and keep decoding, but their outputs keep the pad id and 0.
    Lengths and finish reasons are read from the recorded tokens at the end (:func:`_finish`)."""
    if running is not None:
        tokens = torch.where(running, tokens, pad_id)
        log_probs = torch.where(running, log_probs, 0.0)
    out.token_ids[rows, step] = tokens
    out.log_probs[rows, step] = log_probs
    if stop_ids.numel() == 0:
        return None
    still = ~torch.isin(tokens, stop_ids)
    return still if running is None else running & still


def _finish(out: _Outputs, stop_ids: Tensor) -> None:
    """Each row's length and whether it stopped, from its recorded tokens: a row ends at its first stop token
    (what follows it is padding, which may itself be a stop id); a row without one ran to the end."""
    if stop_ids.numel() == 0:
        return
    hit = torch.isin(out.token_ids, stop_ids)
    out.stopped = hit.any(dim=1)
    out.lengths = torch.where(out.stopped, hit.int().argmax(dim=1) + 1, out.lengths)
    if out.response_experts is not None:  # a finished row decoded padding until the next stop check
        steps = torch.arange(out.token_ids.shape[1], device=out.lengths.device)
        out.response_experts[steps[None, :] >= out.lengths[:, None]] = -1
