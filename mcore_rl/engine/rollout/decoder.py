"""A lean tensor-parallel Llama-family decoder (Llama, Qwen2, Mistral) with a KV cache, for rollout.

It computes the same function as megatron-core's GPTModel with the local layer spec, operation by operation,
so that rollout log-probs match the actor's recomputation in fp32: RMSNorm as ``torch.nn.RMSNorm`` computes
it, non-interleaved rotary with megatron's fp32 ``cos``/``sin`` of ``position * inv_freq``, scores
``(q @ k^T) * (1 / sqrt(head_dim))`` with an fp32 softmax, ``silu(gate) * up``. On CPU at TP1 the full-sequence
logits come out bitwise equal to megatron's; TP2 and KV-cached decoding differ by fp32 rounding (~1e-6, see
tests/rollout).

Performance on CPU (the decode step is a few hundred small ops): fused ``qkv``/``gate_up`` projections,
weights stored column-major so every projection is one NN gemm (``addmm`` folds in the residual at TP1), keys
cached transposed so ``q @ K`` needs no transpose, and sequences left-padded in the cache so each decode step
writes one cache column for the whole batch.

Rollout layout (vLLM's, one TP rank)::

    embed_tokens.weight                         [V_pad / tp, hidden]        vocab rows of this rank
    layers.{i}.input_layernorm.weight           [hidden]
    layers.{i}.self_attn.qkv_proj.weight        [(h + 2 kv) * head_dim, hidden], h = heads / tp,
                                                kv = kv_heads / tp, rows [q_shard; k_shard; v_shard]
    layers.{i}.self_attn.qkv_proj.bias          [(h + 2 kv) * head_dim]     (Qwen2 / attention_bias)
    layers.{i}.self_attn.o_proj.weight          [hidden, h * head_dim]      row-parallel (all-reduce)
    layers.{i}.post_attention_layernorm.weight  [hidden]
    layers.{i}.mlp.gate_up_proj.weight          [2 * ffn / tp, hidden]      rows [gate_shard; up_shard]
    layers.{i}.mlp.down_proj.weight             [hidden, ffn / tp]          row-parallel (all-reduce)
    norm.weight                                 [hidden]
    lm_head.weight                              [V_pad / tp, hidden]        absent when embeddings are tied

``V_pad = padded_vocab_size(vocab, tp, 128)``; padding rows are never real tokens and their logits are
dropped after the all-gather. KV heads are split, never replicated, so ``kv_heads % tp == 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.engine.arch import ModelArch, rope_inv_freq
from mcore_rl.engine.rollout.from_megatron import deinterleave_qkv
from mcore_rl.parallel.layout import padded_vocab_size

VOCAB_DIVISIBLE_BY = 128
"""Vocab padding granularity (times TP), megatron's default, so both sides pad alike."""


_COLUMN_MAJOR = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "lm_head.weight",
)


class _LayerWeights(NamedTuple):
    """One layer's tensors; projections as contiguous [in, out] (the storage under the [out, in] weights), so
    ``x @ w`` is one plain gemm call."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    o_proj: Tensor
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor


class _Step(NamedTuple):
    """What every layer of one forward pass shares."""

    batch: int
    seq: int
    cos: Tensor  # [b or 1, s, 1, rotary_dim]
    sin: Tensor  # [b or 1, s, 1, rotary_dim], signed (see _rope_tables)
    masked: Tensor | None  # [b or 1, 1, 1, s, key_len] bool, True = hidden
    rows: slice  # cache rows of the batch
    column: int  # cache column of the first token


class RolloutLayoutError(ValueError):
    """The model cannot be split for this rollout TP size; the message names the field."""


def check_rollout_tp(arch: ModelArch, tp: int) -> None:
    for name, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_query_groups),
        ("intermediate_size", arch.ffn_hidden_size),
    ):
        if value % tp:
            raise RolloutLayoutError(
                f"{name}={value} is not divisible by the rollout tensor_parallel_size={tp}"
            )


def rollout_param_shapes(arch: ModelArch, tp: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one rank's tensors in the rollout layout (see the module docstring)."""
    check_rollout_tp(arch, tp)
    hidden, hd = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) // tp * hd
    vocab_rows = padded_vocab_size(arch.vocab_size, tp, VOCAB_DIVISIBLE_BY) // tp
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab_rows, hidden)}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.qkv_proj.weight"] = (qkv_rows, hidden)
        if arch.qkv_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, arch.num_attention_heads // tp * hd)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * arch.ffn_hidden_size // tp, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, arch.ffn_hidden_size // tp)
    shapes["norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_rows, hidden)
    return shapes


def _vocab_shard(full: Tensor, arch: ModelArch, tp: int, rank: int) -> Tensor:
    rows = padded_vocab_size(arch.vocab_size, tp, VOCAB_DIVISIBLE_BY)
    padded = torch.cat([full, full.new_zeros(rows - full.shape[0], full.shape[1])])
    return padded.chunk(tp)[rank]


def _qkv_shard(full: Tensor, arch: ModelArch, tp: int, rank: int) -> Tensor:
    """megatron's per-group ``[q heads of the group; k; v]`` rows -> this rank's ``[q; k; v]``."""
    return deinterleave_qkv(full.chunk(tp)[rank], arch)  # TP splits whole query groups


def rollout_shards_from_full(
    full: dict[str, Tensor], arch: ModelArch, tp_g: int, tp_rank: int
) -> dict[str, Tensor]:
    """One rollout rank's tensors from megatron's full state (TP1, real vocab rows; see engine/weights.py).

    The naive oracle of the resharding plan: it slices full tensors, where the plan moves only shards.
    """
    check_rollout_tp(arch, tp_g)
    out = {"embed_tokens.weight": _vocab_shard(full["embedding.word_embeddings.weight"], arch, tp_g, tp_rank)}
    for i in range(arch.num_layers):
        src, dst = f"decoder.layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[dst + "self_attn.qkv_proj.weight"] = _qkv_shard(
            full[src + "self_attention.linear_qkv.weight"], arch, tp_g, tp_rank
        )
        if arch.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = _qkv_shard(
                full[src + "self_attention.linear_qkv.bias"], arch, tp_g, tp_rank
            )
        out[dst + "self_attn.o_proj.weight"] = full[src + "self_attention.linear_proj.weight"].chunk(tp_g, 1)[
            tp_rank
        ]
        out[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat([gate.chunk(tp_g)[tp_rank], up.chunk(tp_g)[tp_rank]])
        out[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"].chunk(tp_g, 1)[tp_rank]
    out["norm.weight"] = full["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = _vocab_shard(full["output_layer.weight"], arch, tp_g, tp_rank)
    return {name: t.contiguous() for name, t in out.items()}


@dataclass
class KVCache:
    """Per-layer keys ``[rows, kv_heads / tp, head_dim, max_len]`` and values ``[rows, kv_heads / tp, max_len,
    head_dim]``; row r is one sequence, column c one token slot.

    Keys are stored transposed so that ``q @ K`` reads them as a plain (not transposed) gemm operand, which
    halves the decode-step score matmul on CPU. Buffers are zero-initialised so that never-written slots
    are finite (a masked score gets probability 0, but 0 * NaN would still poison the context).
    """

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        def zeros(*shape: int) -> list[Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        return cls(zeros(rows, kv_heads, head_dim, max_len), zeros(rows, kv_heads, max_len, head_dim))

    @property
    def max_len(self) -> int:
        return self.values[0].shape[2]

    def _used(self, used_len: int) -> list[Tensor]:
        """Views of every buffer restricted to columns [0, used_len)."""
        return [k[..., :used_len] for k in self.keys] + [v[:, :, :used_len] for v in self.values]

    def repeat_rows(self, num_rows: int, repeats: int, used_len: int) -> None:
        """Rows ``[0, num_rows)`` become rows ``[0, num_rows * repeats)``, each repeated in place (n samples)."""
        for buf in self._used(used_len):
            buf[: num_rows * repeats] = buf[:num_rows].repeat_interleave(repeats, dim=0)

    def keep_rows(self, rows: Tensor, used_len: int) -> None:
        """Compact: rows listed in ``rows`` (ascending) move to the front, in order; the rest is dropped."""
        for buf in self._used(used_len):
            buf[: rows.shape[0]] = buf[rows]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` (what megatron's ``torch.nn.RMSNorm`` runs). In fp32 the same arithmetic spelled out is
    bitwise identical and skips the composite's dtype round trips (a third of its CPU time)."""
    if x.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # x * x is what pow(x, 2) computes and mean is sum / n; in-place ops avoid scalar-to-tensor copies.
    return x * (x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_() * weight


class RolloutDecoder:
    """One TP rank of the decoder; weights in the rollout layout, loaded by name with :meth:`load`.

    ``tp_group`` None runs unsharded. Every rank of the group must call the forward methods together (they
    all-reduce after the row-parallel projections and all-gather the logits).
    """

    def __init__(
        self,
        arch: ModelArch,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.arch = arch
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.device = torch.device(device)
        self.dtype = dtype
        self.shapes = rollout_param_shapes(arch, self.tp_size)
        self.num_heads = arch.num_attention_heads // self.tp_size
        self.num_kv_heads = arch.num_query_groups // self.tp_size
        self.vocab_start = self.shapes["embed_tokens.weight"][0] * self.tp_rank
        self.scale = 1.0 / math.sqrt(arch.head_dim)  # spelled as megatron does: ** -0.5 can differ by an ulp
        self.weights: dict[str, Tensor] = {}
        self._layer_cache: list[_LayerWeights] | None = None
        self.allocate()
        self._inv_freq = rope_inv_freq(arch).to(self.device)
        self._cos = self._sin = torch.empty(0, arch.rotary_dim, device=self.device)
        half = arch.rotary_dim // 2
        self._swap_halves = torch.cat([torch.arange(half, 2 * half), torch.arange(half)]).to(self.device)

    # --- weights -------------------------------------------------------------------------------------------
    def allocate(self) -> None:
        """(Re)create zero weights; they must be loaded before use.

        Projection weights keep their rollout-layout shape [out, in] but live in column-major storage (the
        transpose of a contiguous [in, out] buffer): ``x @ w.t()`` is then an NN gemm, which for the few
        rows of a decode step is 20-30% faster on CPU than the NT gemm of row-major weights.
        """
        self.weights = {}
        self._layer_cache = None
        for name, shape in self.shapes.items():
            if name.endswith(_COLUMN_MAJOR):
                self.weights[name] = torch.zeros(shape[::-1], dtype=self.dtype, device=self.device).t()
            else:
                self.weights[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        self.weights = {}
        self._layer_cache = None

    def load(self, name: str, tensor: Tensor) -> None:
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return  # tied: the head is embed_tokens (vLLM skips it too)
        if name not in self.shapes:
            raise KeyError(f"{name!r} is not a rollout-layout parameter of this model")
        if tuple(tensor.shape) != self.shapes[name]:
            raise ValueError(
                f"{name}: got shape {tuple(tensor.shape)}, this rank expects {self.shapes[name]}"
            )
        self.weights[name].copy_(tensor)

    def to(self, device: torch.device | str) -> None:
        self.weights = {name: t.to(device) for name, t in self.weights.items()}
        self._layer_cache = None

    # --- rotary --------------------------------------------------------------------------------------------
    def _rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin, [length, rotary_dim], fp32 as megatron computes them, grown on demand.

        megatron's ``rotate_half(x) * sin`` is ``[-x2, x1] * sin``; we compute ``[x2, x1] * [-sin1, sin2]``
        (one ``index_select`` instead of chunk, neg and cat), bitwise the same product.
        """
        if self._cos.shape[0] < length:
            length = max(length, 2 * self._cos.shape[0])
            positions = torch.arange(length, device=self.device, dtype=torch.float32)
            freqs = torch.outer(positions, self._inv_freq)
            freqs = torch.cat([freqs, freqs], dim=-1)
            half = freqs.shape[-1] // 2
            sign = torch.ones(freqs.shape[-1], device=self.device)
            sign[:half] = -1.0
            self._cos, self._sin = torch.cos(freqs), torch.sin(freqs) * sign
        return self._cos, self._sin

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary on ``x`` [b, s, heads, head_dim] with cos/sin [b or 1, s, 1, rotary_dim]."""
        if cos.shape[-1] == x.shape[-1]:
            return x * cos + x.index_select(-1, self._swap_halves) * sin
        head, tail = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
        return torch.cat([head * cos + head.index_select(-1, self._swap_halves) * sin, tail], dim=-1)

    # --- tensor-parallel pieces ----------------------------------------------------------------------------
    def _all_reduce(self, x: Tensor) -> Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _project_add(self, residual: Tensor, x: Tensor, weight_t: Tensor) -> Tensor:
        """``residual + all_reduce(x @ weight_t)`` for a row-parallel projection; one ``addmm`` at TP1."""
        if self.tp_size == 1:
            return torch.addmm(residual, x, weight_t)
        return residual + self._all_reduce(torch.mm(x, weight_t))

    def _embed(self, tokens: Tensor) -> Tensor:
        table = self.weights["embed_tokens.weight"]
        if self.tp_size == 1:
            return F.embedding(tokens, table)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= table.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)
        return self._all_reduce(out)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + vocab projection: hidden [n, hidden] -> fp32 logits [n, vocab] (real vocab only)."""
        hidden = _rms_norm(hidden, self.weights["norm.weight"], self.arch.norm_eps)
        head = self.weights["embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"]
        if self.tp_size == 1:  # skip the padding rows' products altogether
            return torch.mm(hidden, head[: self.arch.vocab_size].t()).float()
        local = torch.mm(hidden, head.t()).float()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., : self.arch.vocab_size]

    # --- forward -------------------------------------------------------------------------------------------
    # Sequences are LEFT-padded in the cache: row b's token at position p sits in column ``pad[b] + p``, so all
    # rows write the same column at every decode step (a slice copy, not a scatter). Columns before
    # ``pad[b]`` are masked for every query of row b. ``pad=None`` means no row is padded.

    def prefill(self, tokens: Tensor, pad: Tensor | None, cache: KVCache, rows: slice) -> Tensor:
        """Left-padded prompts [b, s] (``pad`` [b] leading pad tokens) into cache ``rows``, columns [0, s)
        -> fp32 logits [b, vocab] of each prompt's last token."""
        b, s = tokens.shape
        hidden = self._forward(tokens, 0, pad, cache, rows)
        return self.logits(hidden.view(b, s, -1)[:, -1])

    def decode(self, tokens: Tensor, column: int, pad: Tensor | None, cache: KVCache) -> Tensor:
        """One new token per cache row [b], all in cache ``column`` -> fp32 logits [b, vocab]."""
        return self.logits(self._forward(tokens[:, None], column, pad, cache, slice(0, tokens.shape[0])))

    def full_logits(self, tokens: Tensor) -> Tensor:
        """No-cache recompute of whole (unpadded) sequences: tokens [b, s] -> fp32 logits [b, s, vocab]."""
        b, s = tokens.shape
        cache = KVCache.allocate(
            self.arch.num_layers, b, self.num_kv_heads, s, self.arch.head_dim, self.dtype, self.device
        )
        return self.logits(self._forward(tokens, 0, None, cache, slice(0, b))).view(b, s, -1)

    def _layers(self) -> list[_LayerWeights]:
        """Per-layer weight handles, resolved once (not by name on every step)."""
        if self._layer_cache is None:
            w = self.weights
            self._layer_cache = [
                _LayerWeights(
                    input_norm=w[f"layers.{i}.input_layernorm.weight"],
                    qkv=w[f"layers.{i}.self_attn.qkv_proj.weight"].t(),
                    qkv_bias=w.get(f"layers.{i}.self_attn.qkv_proj.bias"),
                    o_proj=w[f"layers.{i}.self_attn.o_proj.weight"].t(),
                    post_norm=w[f"layers.{i}.post_attention_layernorm.weight"],
                    gate_up=w[f"layers.{i}.mlp.gate_up_proj.weight"].t(),
                    down=w[f"layers.{i}.mlp.down_proj.weight"].t(),
                )
                for i in range(self.arch.num_layers)
            ]
        return self._layer_cache

    def _forward(
        self, tokens: Tensor, column: int, pad: Tensor | None, cache: KVCache, rows: slice
    ) -> Tensor:
        """tokens [b, s] for cache columns [column, column + s) -> hidden [b * s, hidden] before the final
        norm; their keys and values are written into cache ``rows``. Activations stay 2-D (token-major) so
        every projection is a single plain gemm."""
        b, s = tokens.shape
        cos_table, sin_table = self._rope_tables(column + s)
        if pad is None:  # every row at position == column: a slice of the tables, shared by the batch
            cos, sin = cos_table[column : column + s, None], sin_table[column : column + s, None]
        else:
            positions = (torch.arange(column, column + s, device=tokens.device) - pad[:, None]).clamp_min_(0)
            cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
        if self.dtype != torch.float32:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        step = _Step(b, s, cos, sin, self._attention_mask(column, s, pad), rows, column)
        x = self._embed(tokens.reshape(-1))
        for layer, keys, values in zip(self._layers(), cache.keys, cache.values, strict=True):
            x = self._attention_block(layer, x, step, keys, values)
            x = self._mlp_block(layer, x)
        return x

    def _attention_mask(self, column: int, s: int, pad: Tensor | None) -> Tensor | None:
        """[b or 1, 1, 1, s, key_len] bool, True where a query must NOT see a key: the future, the row's left
        padding, and with a sliding window W the keys at or before ``query - W``. None: nothing is masked."""
        window = self.arch.sliding_window
        key_len = column + s
        if s == 1 and pad is None and (window is None or key_len <= window):
            return None
        keys = torch.arange(key_len, device=self.device)
        queries = torch.arange(column, key_len, device=self.device)[:, None]
        masked = keys > queries  # [s, key_len]
        if window is not None:
            masked = masked | (keys <= queries - window)
        if pad is not None:
            masked = masked | (keys < pad[:, None, None])  # [b, s, key_len]
        return masked.view(-1, 1, 1, s, key_len)

    def _attention_block(
        self, layer: _LayerWeights, x: Tensor, step: _Step, keys: Tensor, values: Tensor
    ) -> Tensor:
        # narrow() rather than tensor[...] indexing: this runs for every layer of every decode step, and
        # Python-side index parsing costs more than the tiny copies themselves.
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.arch.head_dim
        b, s, column, first_row = step.batch, step.seq, step.column, step.rows.start
        h = _rms_norm(x, layer.input_norm, self.arch.norm_eps)
        qkv = torch.mm(h, layer.qkv) if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, h, layer.qkv)
        qk = self._rotate(qkv.narrow(1, 0, (nh + nkv) * hd).view(b, s, nh + nkv, hd), step.cos, step.sin)
        keys = keys.narrow(0, first_row, b).narrow(3, 0, column + s)
        values = values.narrow(0, first_row, b).narrow(2, 0, column + s)
        keys.narrow(3, column, s).copy_(qk.narrow(2, nh, nkv).permute(0, 2, 3, 1))
        values.narrow(2, column, s).copy_(
            qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view(b, s, nkv, hd).transpose(1, 2)
        )
        context = self._attend(qk.narrow(2, 0, nh), keys, values, step.masked)
        return self._project_add(x, context, layer.o_proj)

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, masked: Tensor | None) -> Tensor:
        """q [b, s, heads, hd], keys [b, kv, hd, key_len], values [b, kv, key_len, hd] -> context
        [b * s, heads * hd].

        The query heads of one KV head are folded into the matmul's row dim instead of repeating keys, and
        the softmax runs in fp32 like megatron's (``attention_softmax_in_fp32``). Masked scores get the
        most negative float rather than -inf: a query that sees nothing (a left-pad column) then averages
        finite values instead of producing NaN; for every other query the two are identical, since
        ``exp(min - max)`` is exactly 0.
        """
        b, s, nh, hd = q.shape
        nkv, key_len = keys.shape[1], keys.shape[3]
        group = nh // nkv
        # 3-D views for bmm directly (torch.matmul on 4-D adds a dozen expand/reshape calls per layer).
        if s == 1:
            q = q.reshape(b * nkv, group, hd)
        else:
            q = q.reshape(b, s, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(b * nkv, group * s, hd)
        scores = torch.bmm(q, keys.reshape(b * nkv, hd, key_len)).mul_(self.scale)
        if scores.dtype != torch.float32:
            scores = scores.float()
        if masked is not None:
            scores = scores.view(b, nkv, group, s, key_len).masked_fill_(
                masked, torch.finfo(torch.float32).min
            )
        probs = torch.softmax(scores.view(b * nkv, group * s, key_len), dim=-1)
        if probs.dtype != values.dtype:
            probs = probs.to(values.dtype)
        context = torch.bmm(probs, values.reshape(b * nkv, key_len, hd))  # [b * kv, group * s, hd]
        if s == 1:
            return context.view(b, nh * hd)
        return context.view(b, nkv, group, s, hd).permute(0, 3, 1, 2, 4).reshape(b * s, nh * hd)

    def _mlp_block(self, layer: _LayerWeights, x: Tensor) -> Tensor:
        h = _rms_norm(x, layer.post_norm, self.arch.norm_eps)
        gate, up = torch.mm(h, layer.gate_up).chunk(2, dim=-1)
        return self._project_add(x, F.silu(gate) * up, layer.down)
