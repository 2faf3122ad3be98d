"""The embedded engine's conversations between turns: their KV cache, kept so that a multi-turn rollout's next
turn computes only the tokens appended since (the tool's answer), never the context the engine already has.

Token in, token out: every call names each conversation and gives its whole context (prompt, the model's
turns, the tools' answers). A conversation whose cached tokens are a prefix of its new context reuses them;
any other one (new, evicted, or edited) is computed from its first token. The cache holds exactly the
conversations of the last call (of its last wave when they do not fit ``max_cache_tokens`` together).

Layout (``KVCache``, the decoder's left-padded convention): row r holds one conversation, its token at position
p in column ``pad[r] + p``, so a decode step writes one column for the whole batch. One turn::

    rows reused first (request order), new rows after         ─┐
    align: shift each reused row so its cached tokens end at C0 = the longest cached length (a per-row gather)
    extend: the new tokens of every row, right-padded to S, forwarded at columns [C0, C0 + S) in one pass
    shift again: each row right by S - its new tokens, so every row ends at C0 + S (no hole in any row)
    decode: sample, record, decode at C0 + S + step; a finished row swaps places with the last live row
            (its cache stays, for the next turn), the live ones stay rows [0, b)

The right padding of the extension sits after each row's real tokens, where no real query reads it (causal),
and the second shift writes over it. Rotary positions are ``column - pad``: both shifts move a row's pad with
its columns, so every key keeps its position. A row's cached tokens are its context plus what it sampled,
less the last sampled token (stop or length), whose key was never computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.engine.rollout.decoder import RolloutDecoder
from mcore_rl.engine.rollout.kv_cache import KVCache
from mcore_rl.engine.rollout.sampling import sample_tokens

from .base import SamplingParams


@dataclass
class _Row:
    """What one cache row holds."""

    conversation: int
    tokens: list[int]
    """Tokens whose keys and values are cached, positions 0.. in columns ``pad``.."""
    pad: int


@dataclass
class TurnOutputs:
    """One turn's samples, in request order (``GenerationOutput``'s fields before wrapping)."""

    token_ids: Tensor  # [A, T] int64, the pad id after each row's end
    log_probs: Tensor  # [A, T] fp32, 0 after each row's end
    lengths: Tensor  # [A] int64
    stopped: Tensor  # [A] bool: ended with a stop token


class ConversationCache:
    """The KV cache of an engine's live conversations (module docstring); one per engine, on its device."""

    def __init__(self, decoder: RolloutDecoder, dtype: torch.dtype, device: torch.device) -> None:
        self.decoder = decoder
        self.dtype = dtype
        self.device = device
        self.cache: KVCache | None = None
        self.rows: list[_Row] = []
        self.reused_tokens = 0
        """Context tokens the last call found cached (not recomputed): the saving, for tests and logs."""

    def clear(self) -> None:
        """Forget every conversation and free the buffers (new weights, sleep)."""
        self.cache, self.rows = None, []

    def plan_reuse(self, ids: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[int]:
        """Per request: its cached tokens to reuse (0: computed from scratch)."""
        held = {row.conversation: row for row in self.rows}
        reuse = []
        for conversation, context in zip(ids, contexts, strict=True):
            row = held.get(conversation)
            n = len(row.tokens) if row is not None else 0
            ok = row is not None and n < len(context) and list(context[:n]) == row.tokens
            reuse.append(n if ok else 0)
        return reuse

    # --- one turn -----------------------------------------------------------------------------------------
    def turn(
        self,
        ids: Sequence[int],
        contexts: Sequence[Sequence[int]],
        max_new: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
        stop_check_interval: int,
    ) -> TurnOutputs:
        """Sample one turn for every requested conversation (all fitting the cache together); outputs in
        request order."""
        reuse = self.plan_reuse(ids, contexts)
        held = {row.conversation: i for i, row in enumerate(self.rows)}
        order = [i for i in range(len(ids)) if reuse[i]] + [i for i in range(len(ids)) if not reuse[i]]
        kept = [held[ids[i]] for i in order if reuse[i]]
        kept_rows = [self.rows[r] for r in kept]
        cached = [reuse[i] for i in order]
        suffixes = [list(contexts[i][cached[j] :]) for j, i in enumerate(order)]
        c0, width = max(cached), max(len(s) for s in suffixes)
        end = c0 + width
        cache = self._cache_for(len(order), end + max(max_new), kept)
        self._align(cache, kept_rows, c0)
        logits = self._extend(cache, suffixes, cached, c0)
        shift = [width - len(s) for s in suffixes]
        if any(shift):
            _shift_rows(cache, torch.tensor(shift, device=self.device), end)
        # cache-row order from here on: every context is cached and ends at column ``end``
        self.rows = [_Row(ids[i], list(contexts[i]), end - len(contexts[i])) for i in order]
        self.reused_tokens = sum(cached)
        slot_max_new = [max_new[i] for i in order]
        out = self._decode(cache, logits, slot_max_new, end, params, generator, stop_check_interval)
        back = torch.argsort(torch.tensor(order, device=self.device))  # cache-row (slot) -> request order
        return TurnOutputs(out.token_ids[back], out.log_probs[back], out.lengths[back], out.stopped[back])

    def _cache_for(self, rows: int, max_len: int, kept: list[int]) -> KVCache:
        """A cache of at least ``rows`` x ``max_len`` slots whose rows [0, len(kept)) are the old rows ``kept``
        (their columns as they were): the old buffers reordered in place, or new ones they are copied into."""
        old = self.cache
        used = max((self.rows[r].pad + len(self.rows[r].tokens) for r in kept), default=0)
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        if old is not None and old.rows >= rows and old.max_len >= max(max_len, used):
            if kept != list(range(len(kept))):
                for buf in _buffers(old, used):
                    buf[: len(kept)] = buf[index]  # advanced indexing reads a copy first: any order is safe
            return old
        arch = self.decoder.arch
        self.cache = None  # the old buffers may go as soon as their rows are copied
        new = KVCache.allocate(
            arch.num_layers,
            max(rows, old.rows if old is not None else 0),
            self.decoder.num_kv_heads,
            max(max_len, used),
            arch.head_dim,
            self.dtype,
            self.device,
        )
        if old is not None and kept:
            for dst, src in zip(_buffers(new, used), _buffers(old, used), strict=True):
                dst[: len(kept)] = src[index]
        self.cache = new
        return new

    def _align(self, cache: KVCache, kept: list[_Row], c0: int) -> None:
        """Rows [0, len(kept)): each row's cached tokens moved to end at column ``c0``."""
        if not kept:
            return
        shift = [c0 - len(row.tokens) - row.pad for row in kept]
        if any(shift):
            used = max(c0, *(row.pad + len(row.tokens) for row in kept))
            _shift_rows(cache, torch.tensor(shift, device=self.device), used)

    def _extend(self, cache: KVCache, suffixes: list[list[int]], cached: list[int], c0: int) -> Tensor:
        """Every row's new tokens at columns [c0, c0 + S), right-padded -> fp32 logits [A, vocab] after each
        row's last one. When nothing is cached, equal contexts are computed once (a rollout's first turn
        holds each prompt n times) and their rows copied."""
        width = max(len(s) for s in suffixes)
        if any(cached):
            source = list(range(len(suffixes)))
        else:
            unique: dict[tuple[int, ...], int] = {}
            source = [unique.setdefault(tuple(s), len(unique)) for s in suffixes]
        firsts: dict[int, int] = {}
        for row, u in enumerate(source):
            firsts.setdefault(u, row)
        computed = list(firsts.values())  # in order of first appearance, u = 0, 1, ...
        tokens = torch.zeros(len(computed), width, dtype=torch.long)
        for row, j in enumerate(computed):
            tokens[row, : len(suffixes[j])] = torch.as_tensor(suffixes[j])
        pads = [c0 - cached[j] for j in computed]
        pad = torch.tensor(pads, device=self.device) if any(pads) else None
        # The decoder's multi-token forward at a cache column (``prefill`` is its column-0 case).
        hidden = self.decoder._forward(tokens.to(self.device), c0, pad, cache, slice(0, len(computed)))
        last = torch.tensor([len(suffixes[j]) - 1 for j in computed], device=self.device)
        rows = torch.arange(len(computed), device=self.device)
        logits = self.decoder.logits(hidden.view(len(computed), width, -1)[rows, last])
        if len(computed) < len(suffixes):
            index = torch.tensor(source, device=self.device)
            for buf in _buffers(cache, c0 + width):
                buf[: len(suffixes)] = buf[index]
            logits = logits[index]
        return logits

    def _decode(
        self,
        cache: KVCache,
        logits: Tensor,
        max_new: list[int],
        start: int,
        params: SamplingParams,
        generator: torch.Generator,
        interval: int,
    ) -> TurnOutputs:
        """The decode loop over cache rows [0, A), outputs in slot order (the rows' order at the start);
        each row stops at a stop token or its own ``max_new``; finished rows swap to the back at each check
        (``interval`` steps), keeping their cache, and their cached tokens gain what they sampled."""
        num, longest, device = len(max_new), max(max_new), self.device
        out = TurnOutputs(
            token_ids=torch.full((num, longest), params.pad_token_id, dtype=torch.long, device=device),
            log_probs=torch.zeros(num, longest, device=device),
            lengths=torch.tensor(max_new, dtype=torch.long, device=device),
            stopped=torch.zeros(num, dtype=torch.bool, device=device),
        )
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        limit = torch.tensor(max_new, device=device)
        slots = list(self.rows)  # _Row objects move with their cache rows; slots keep the output order
        pads = torch.tensor([row.pad for row in slots], device=device)
        where = torch.arange(num, device=device)  # the slot of each live cache row [0, b)
        done = torch.zeros(num, dtype=torch.bool, device=device)  # per live row, since the last check
        self.decoder.start_decoding(num)
        for step in range(longest):
            tokens, log_probs = sample_tokens(logits, params, generator)
            live = ~done
            out.token_ids[where, step] = torch.where(live, tokens, params.pad_token_id)
            out.log_probs[where, step] = torch.where(live, log_probs, 0.0)
            hit = torch.isin(tokens, stop_ids) & live
            out.stopped[where] = out.stopped[where] | hit
            out.lengths[where] = torch.where(hit, step + 1, out.lengths[where])
            done = done | hit | (limit[where] <= step + 1)
            if step + 1 == longest:
                break
            if (step + 1) % interval == 0 and bool(done.any()):  # the loop's only host sync
                if bool(done.all()):
                    break
                perm = self._retire(cache, done, start + step)
                where, tokens = where[perm], tokens[perm]
                done = torch.zeros(perm.numel(), dtype=torch.bool, device=device)
            logits = self.decoder.decode(tokens, start + step, pads[where], cache)
        sampled, lengths = out.token_ids.tolist(), out.lengths.tolist()
        for slot, row in enumerate(slots):
            row.tokens = row.tokens + sampled[slot][: lengths[slot] - 1]  # the last one was never decoded
        return out

    def _retire(self, cache: KVCache, done: Tensor, used: int) -> Tensor:
        """The finished rows among the live rows [0, b) swap places with the last live ones, so the live rows
        become [0, b') and every finished row keeps its cache. Returns, for each new live row, the old live
        row whose content it now holds (``perm`` [b'])."""
        live = torch.nonzero(~done).squeeze(1)
        finished = torch.nonzero(done).squeeze(1)
        remaining = live.numel()
        holes = finished[finished < remaining]  # finished rows inside the new live range
        movers = live[live >= remaining]  # as many live rows past it
        perm = torch.arange(remaining, device=done.device)
        if holes.numel():
            perm[holes] = movers
            a, b = torch.cat([holes, movers]), torch.cat([movers, holes])
            for buf in _buffers(cache, used):
                buf[a] = buf[b]  # a swap: the right side is read into a copy first
            rows = self.rows
            swapped = [rows[j] for j in b.tolist()]
            for i, row in zip(a.tolist(), swapped, strict=True):
                rows[i] = row
        return perm


def _buffers(cache: KVCache, used: int) -> list[Tensor]:
    """Every buffer's columns [0, used), with the column as the last dim for keys and dim 2 for values."""
    return [k[..., :used] for k in cache.keys] + [v[:, :, :used] for v in cache.values]


def _shift_rows(cache: KVCache, shift: Tensor, used: int) -> None:
    """Rows [0, len(shift)) moved right by ``shift[r]`` columns (negative: left) within columns [0, used);
    what enters from outside is a copy of column 0 or used - 1 (left padding: never read)."""
    rows = shift.numel()
    columns = (torch.arange(used, device=shift.device)[None, :] - shift[:, None]).clamp_(0, used - 1)
    for keys in cache.keys:  # [rows, kv, hd, len]: the column is the last dim
        part = keys[:rows, :, :, :used]
        index = columns[:, None, None, :].expand_as(part)
        part.copy_(part.gather(3, index))
    for values in cache.values:  # [rows, kv, len, hd]
        part = values[:rows, :, :used]
        index = columns[:, None, :, None].expand_as(part)
        part.copy_(part.gather(2, index))
