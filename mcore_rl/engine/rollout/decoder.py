"""A lean tensor-parallel Llama-family decoder (Llama, Qwen2, Qwen3, Mistral; Qwen3-MoE and Mixtral with the
mixture-of-experts MLP of ``rollout/moe.py``) with a KV cache, for rollout.

It computes the same function as megatron-core's GPTModel with the local layer spec, operation by operation,
so that rollout log-probs match the actor's recomputation in fp32: RMSNorm as ``torch.nn.RMSNorm`` computes
it, non-interleaved rotary with megatron's fp32 ``cos``/``sin`` of ``position * inv_freq``, scores
``(q @ k^T) * (1 / sqrt(head_dim))`` (times YaRN's attention factor squared: ``engine/rope.py``) with an fp32
softmax (plain causal attention through torch's fused kernel, as the trainer's local spec runs it:
``compat/cpu_layers.py``), ``silu(gate) * up``. On CPU at TP1 the
full-sequence logits come out bitwise equal to the trainer's; TP2 and KV-cached decoding differ by fp32
rounding (~1e-6, see tests/engine/rollout).

Performance on CPU: fused ``qkv``/``gate_up`` projections, each projection of a multi-token forward (prefill,
recompute) one gemm (``addmm`` folds in the residual at TP1), keys cached transposed, and sequences left-padded
in the cache so each decode step writes one cache column for the whole batch. A decode step (one token per
sequence, :meth:`RolloutDecoder.decode`) runs the fused kernels of :mod:`mcore_rl.ops.decode` in fp32 on CPU:
RMSNorm and SiLU-gate in one pass each, rotary + cache write + GQA attention in one kernel, and the projections
on weights packed once per generation: our column panels (AVX2 or AVX-512 kernels), or on Intel CPUs with
AVX-512 MKL's packed GEMM operand (``rollout/projection.py``). Weights stay row-major as megatron holds them
where decode steps run on a packed copy (a straight copy on load), column-major elsewhere (an NN gemm for a
few rows). bench/bench_rollout.py measures the
result against ``transformers`` ``generate``.

The rollout layout (tensor names and shapes of one TP rank) is defined in ``rollout/layout.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import attention, moe
from mcore_rl.engine.rollout.kv_cache import KVCache
from mcore_rl.engine.rollout.layout import rollout_param_shapes
from mcore_rl.engine.rollout.projection import DecodePacking, Projection, linear, panels_pay
from mcore_rl.engine.rollout.rotary import RotaryTables
from mcore_rl.engine.rope import attention_softmax_scale
from mcore_rl.ops import decode as fused
from mcore_rl.ops.reference import rms_norm as rms_norm_spelled_out
from mcore_rl.ops.reference import rotate_signed_halves

_COLUMN_MAJOR = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "lm_head.weight",
)


class _LayerWeights(NamedTuple):
    """One layer's tensors, resolved once from the weights dict."""

    input_norm: Tensor
    qkv: Projection
    qkv_bias: Tensor | None
    q_norm: Tensor | None  # Qwen3: RMSNorm weight [head_dim] of each query head, before rotary
    k_norm: Tensor | None
    o_proj: Projection
    post_norm: Tensor
    gate_up: Projection | None  # None in a mixture-of-experts layer
    down: Projection | None
    experts: moe.ExpertWeights | None = None  # the router and stacked experts of a mixture-of-experts layer


class _Step(NamedTuple):
    """What every layer of one multi-token forward pass (prefill, recompute) shares."""

    batch: int
    seq: int
    cos: Tensor  # [b or 1, s, 1, rotary_dim] in the model dtype
    sin: Tensor  # [b or 1, s, 1, rotary_dim], signed (see rollout/rotary.py)
    masked: Tensor | None  # [b or 1, 1, 1, s, key_len] bool, True = hidden
    plain_causal: bool  # masked is exactly the causal mask of s tokens from column 0 (the trainer's case)
    rows: slice  # cache rows of the batch
    column: int  # cache column of the first token


class _DecodeOps(NamedTuple):
    """The pointwise and attention kernels of one decode step (see ``ops/decode.py`` for their contracts)."""

    rms_norm: Callable[..., Tensor]
    silu_mul: Callable[..., Tensor]
    attention: Callable[..., Tensor]


def _decode_ops(device: torch.device, dtype: torch.dtype) -> _DecodeOps:
    """The compiled kernels called directly when they apply (CPU fp32, extension loaded, no reference
    override), else ``ops.decode``'s wrappers, which fall back to the references.

    Resolved once per step: the wrappers' per-call checks (an environment read and a contiguity test of every
    input) cost a few microseconds each, ~20 times a step. Every decode-step input is contiguous by
    construction, and the kernels reject one that is not rather than computing garbage.
    """
    if fused.packing_enabled(device, dtype):
        ops = torch.ops.mcore_rl
        return _DecodeOps(ops.rms_norm, ops.silu_mul, ops.decode_attention)
    return _DecodeOps(fused.rms_norm, fused.silu_mul, fused.decode_attention)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` (what megatron's ``torch.nn.RMSNorm`` runs); in fp32 its arithmetic spelled out, bitwise
    the same and a third cheaper on CPU (see ``ops.reference.rms_norm``)."""
    if x.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_spelled_out(x, weight, eps)


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
        self.scale = attention_softmax_scale(arch)  # the actor's: megatron's default, YaRN's factor folded in
        self.routing: list[Tensor] | None = None
        """Mixture-of-experts models: when a list, every forward appends each MoE layer's chosen experts
        ([tokens, top_k] int64, layer order) to it; the engine records the rollout's routing this way."""
        self.weights: dict[str, Tensor] = {}
        self._layer_cache: list[_LayerWeights] | None = None
        self._head: Projection | None = None
        self.allocate()
        self.rotary = RotaryTables(arch, self.device)

    # --- weights -------------------------------------------------------------------------------------------
    def allocate(self) -> None:
        """(Re)create zero weights; they must be loaded before use.

        Projection weights keep their rollout-layout shape [out, in]. Where decode steps use no packed weights
        (bf16, GPU, torch without MKL, one thread without panels) they live in column-major storage (the
        transpose of a contiguous [in, out] buffer): ``x @ w.t()`` is then an NN gemm, which for a few rows is
        20-30% faster on CPU than the NT gemm of row-major weights. Where decode steps run on a packed copy
        (our panels, MKL's packed GEMM: :meth:`_mkl_decode`) they stay row-major as megatron holds them: the
        weight sync is then a straight copy (the realistic model's 209.5 MiB load 66 -> 12 ms against
        column-major storage, one process, 2026-12-06), and only prefill's few GEMMs run NT (0-15% slower per GEMM).
        """
        self.weights = {}
        self._packs_for_decode = self._mkl_decode()
        column_major = not (self._packs_for_decode or panels_pay(self.device, self.dtype))
        self._invalidate()
        self.weights.update(moe.allocate_experts(self.shapes, self.dtype, self.device))
        for name, shape in self.shapes.items():
            if name in self.weights:  # an expert's view of its layer's stacked weights
                continue
            if name.endswith(_COLUMN_MAJOR) and column_major:
                self.weights[name] = torch.zeros(shape[::-1], dtype=self.dtype, device=self.device).t()
            else:
                self.weights[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _mkl_decode(self) -> bool:
        """Whether decode steps run their projections on MKL-packed weights (``DecodePacking``), decided when the
        weights are allocated. Packed weights pay with 2+ threads, where MKL's packed GEMM threads a few rows
        far better than its plain one (at 32 rows and hidden 256: 1.4x the plain NN gemm over the layer's
        projections); on one thread the plain NN gemm of column-major weights is ~5% faster. Packed weights
        stay row-major [out, in] as megatron holds them: a straight copy on load, a fast pack (packing a
        column-major view is ~15x slower), and multi-token forwards run megatron's own NT gemm."""
        return (
            fused.mkl_packing_available(self.device, self.dtype)
            and not panels_pay(self.device, self.dtype)
            and torch.get_num_threads() > 1
        )

    def release(self) -> None:
        self.weights = {}
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget the resolved per-layer handles and packed panels (weights changed or moved)."""
        self._layer_cache = None
        self._flat: list[Tensor] | None = None
        self._head = None
        self._flat_rows = 0
        self.packing = DecodePacking(self._packs_for_decode)

    @torch.no_grad()  # a kept training shard arrives as the parameter itself, which requires grad
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
        self._invalidate()

    def to(self, device: torch.device | str) -> None:
        self.weights = moe.moved_weights(self.weights, device)
        self._invalidate()

    # --- tensor-parallel pieces ----------------------------------------------------------------------------
    def _all_reduce(self, x: Tensor) -> Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _projection(self, weight_t: Tensor) -> Projection:
        if weight_t.shape[1] == 0:  # a vocab shard of padding only: nothing to pack
            return Projection(weight_t, None)
        if panels_pay(weight_t.device, weight_t.dtype):
            return Projection(weight_t, fused.pack_panels(weight_t))
        return Projection(weight_t, None, [] if self._packs_for_decode else None)

    def start_decoding(self, rows: int) -> None:
        """A generation's decode steps start from weights packed for its batch size (kept when they already
        are), so that its outputs do not depend on earlier calls."""
        if self.packing.start(rows, self._packed_projections()):
            self._flat = None

    def _packed_projections(self) -> list[Projection]:
        layers = self._layers()
        projections = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in layers]
        return [p for group in projections for p in group if p is not None] + [self._head_projection()]

    def _project_add(self, residual: Tensor, x: Tensor, proj: Projection, decoding: bool) -> Tensor:
        """``residual + all_reduce(x @ weight_t)`` for a row-parallel projection; one fused call at TP1."""
        if self.tp_size == 1:
            return linear(x, proj, residual, decoding)
        return residual + self._all_reduce(linear(x, proj, None, decoding))

    def _embed(self, tokens: Tensor) -> Tensor:
        table = self.weights["embed_tokens.weight"]
        if self.tp_size == 1:
            return F.embedding(tokens, table)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= table.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)
        return self._all_reduce(out)

    def logits(self, hidden: Tensor, decoding: bool = False) -> Tensor:
        """Final norm + vocab projection: hidden [n, hidden] -> fp32 logits [n, vocab] (real vocab only)."""
        hidden = self._norm(hidden, self.weights["norm.weight"], decoding)
        if self.tp_size == 1:
            return linear(hidden, self._head_projection(), None, decoding).float()
        local = linear(hidden, self._head_projection(), None, decoding).float()
        shard = self.shapes["embed_tokens.weight"][0]
        if local.shape[1] < shard:  # this rank's padding rows were never multiplied: zero columns for them
            local = F.pad(local, (0, shard - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., : self.arch.vocab_size]

    def _head_projection(self) -> Projection:
        if self._head is None:
            head = self.weights["embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"]
            # Only this rank's real vocab rows: megatron's padding rows never enter a GEMM.
            real = max(0, min(self.arch.vocab_size - self.vocab_start, head.shape[0]))
            self._head = self._projection(head[:real].t())
        return self._head

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
        """One new token per cache row [b], all in cache ``column`` -> fp32 logits [b, vocab].

        The generation loop's hot path, kept to one call per block: RMSNorm, projection, fused rotary + cache
        write + attention, projection (+ residual), RMSNorm, projection, SiLU-gate, projection (+ residual).
        """
        b = tokens.shape[0]
        ops = _decode_ops(self.device, self.dtype)
        cos, sin = self.rotary.at_decode(b, column, pad)
        first = attention.first_visible(b, column, pad, self.arch.sliding_window, self.device)
        eps, heads, scale = self.arch.norm_eps, self.num_heads, self.scale
        x = self._embed(tokens)
        if self.packing.pack_for(b, self._packed_projections):
            self._flat = None
        if self._native_step(ops):
            # The loop below in one native call: the same kernels in the same order (bitwise the same).
            x = torch.ops.mcore_rl.decode_layers(
                x,
                self._flat_layers(b),
                cache.keys,
                cache.values,
                cos,
                sin,
                column,
                first,
                heads,
                scale,
                eps,
                self.packing.rows_for(b),
            )
            return self.logits(x, decoding=True)
        for layer, keys, values in zip(self._layers(), cache.keys, cache.values, strict=True):
            if keys.shape[0] != b:  # rows [0, b) of the cache hold the batch
                keys, values = keys.narrow(0, 0, b), values.narrow(0, 0, b)
            qkv = linear(ops.rms_norm(x, layer.input_norm, eps), layer.qkv, layer.qkv_bias, True)
            if layer.q_norm is not None:
                qkv = self._norm_qk(qkv, layer)
            context = ops.attention(qkv, cos, sin, keys, values, column, first, heads, scale)
            x = self._project_add(x, context, layer.o_proj, decoding=True)
            if layer.experts is not None:
                x = x + self._experts(ops.rms_norm(x, layer.post_norm, eps), layer.experts)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate_up = linear(ops.rms_norm(x, layer.post_norm, eps), layer.gate_up, None, True)
            x = self._project_add(x, ops.silu_mul(gate_up), layer.down, decoding=True)
        return self.logits(x, decoding=True)

    def _native_step(self, ops: _DecodeOps) -> bool:
        """Whether a decode step runs its layers in one ``decode_layers`` call: the compiled kernels apply
        and there is no tensor parallelism (whose all-reduces sit between the kernels) nor Qwen3's q/k norms
        (which the native loop does not run)."""
        native = ops.attention is getattr(torch.ops.mcore_rl, "decode_attention", None)
        return self.tp_size == 1 and not self.arch.qk_norm and self.arch.moe is None and native

    def _flat_layers(self, rows: int) -> list[Tensor]:
        """``decode_layers``' weights for ``rows`` rows: per layer the norms, the QKV bias and each projection's
        [in, out] weight and packed form (:meth:`Projection.decode_packed`), empty tensors for absent ones;
        resolved once per load and packing like :meth:`_layers`."""
        if self._flat is None or self._flat_rows != rows:
            none = torch.empty(0, dtype=self.dtype, device=self.device)

            def projection(p: Projection) -> list[Tensor]:
                packed = p.decode_packed(rows)
                return [p.weight_t, none if packed is None else packed]

            self._flat_rows = rows
            self._flat = []
            for layer in self._layers():
                self._flat += [layer.input_norm, layer.post_norm]
                self._flat.append(none if layer.qkv_bias is None else layer.qkv_bias)
                assert layer.gate_up is not None and layer.down is not None  # dense (no native MoE step)
                for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    self._flat += projection(proj)
        return self._flat

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
                    qkv=self._projection(w[f"layers.{i}.self_attn.qkv_proj.weight"].t()),
                    qkv_bias=w.get(f"layers.{i}.self_attn.qkv_proj.bias"),
                    q_norm=w.get(f"layers.{i}.self_attn.q_norm.weight"),
                    k_norm=w.get(f"layers.{i}.self_attn.k_norm.weight"),
                    o_proj=self._projection(w[f"layers.{i}.self_attn.o_proj.weight"].t()),
                    post_norm=w[f"layers.{i}.post_attention_layernorm.weight"],
                    gate_up=self._optional_projection(w.get(f"layers.{i}.mlp.gate_up_proj.weight")),
                    down=self._optional_projection(w.get(f"layers.{i}.mlp.down_proj.weight")),
                    experts=moe.layer_experts(w, i),
                )
                for i in range(self.arch.num_layers)
            ]
        return self._layer_cache

    def _forward(
        self, tokens: Tensor, column: int, pad: Tensor | None, cache: KVCache, rows: slice
    ) -> Tensor:
        """tokens [b, s] for cache columns [column, column + s) -> hidden [b * s, hidden] before the final
        norm; their keys and values are written into cache ``rows``. Activations stay 2-D (token-major) so
        every projection is a single plain gemm. Prefill and recompute; a decode step runs :meth:`decode`."""
        b, s = tokens.shape
        cos, sin = self.rotary.at_forward(s, column, pad, self.dtype)
        window = self.arch.sliding_window
        plain_causal = pad is None and column == 0 and window is None
        step = _Step(
            b,
            s,
            cos,
            sin,
            attention.attention_mask(column, s, pad, window, self.device),
            plain_causal,
            rows,
            column,
        )
        x = self._embed(tokens.reshape(-1))
        for layer, keys, values in zip(self._layers(), cache.keys, cache.values, strict=True):
            x = self._attention_block(layer, x, step, keys, values)
            x = self._mlp_block(layer, x)
        return x

    def _attention_block(
        self, layer: _LayerWeights, x: Tensor, step: _Step, keys: Tensor, values: Tensor
    ) -> Tensor:
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.arch.head_dim
        b, s, column, first_row = step.batch, step.seq, step.column, step.rows.start
        h = _rms_norm(x, layer.input_norm, self.arch.norm_eps)
        qkv = linear(h, layer.qkv, layer.qkv_bias, decoding=False)
        if layer.q_norm is not None:
            qkv = self._norm_qk(qkv, layer)
        qk = rotate_signed_halves(
            qkv.narrow(1, 0, (nh + nkv) * hd).view(b, s, nh + nkv, hd), step.cos, step.sin
        )
        keys = keys.narrow(0, first_row, b).narrow(3, 0, column + s)
        values = values.narrow(0, first_row, b).narrow(2, 0, column + s)
        keys.narrow(3, column, s).copy_(qk.narrow(2, nh, nkv).permute(0, 2, 3, 1))
        values.narrow(2, column, s).copy_(
            qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view(b, s, nkv, hd).transpose(1, 2)
        )
        if step.plain_causal:
            context = attention.attend_causal(qk.narrow(2, 0, nh), keys, values, self.scale)
        else:
            context = attention.attend(qk.narrow(2, 0, nh), keys, values, step.masked, self.scale)
        return self._project_add(x, context, layer.o_proj, decoding=False)

    def _norm_qk(self, qkv: Tensor, layer: _LayerWeights) -> Tensor:
        """Qwen3's RMSNorm of each query and key head over ``head_dim`` (megatron's ``q_layernorm`` /
        ``k_layernorm``, applied where it applies them: after the projection, before rotary); values as
        they are. qkv [n, (heads + 2 kv) * hd] -> the same layout."""
        assert layer.q_norm is not None and layer.k_norm is not None
        nh, nkv, hd, eps = self.num_heads, self.num_kv_heads, self.arch.head_dim, self.arch.norm_eps
        n = qkv.shape[0]
        q = _rms_norm(qkv.narrow(1, 0, nh * hd).reshape(n, nh, hd), layer.q_norm, eps)
        k = _rms_norm(qkv.narrow(1, nh * hd, nkv * hd).reshape(n, nkv, hd), layer.k_norm, eps)
        return torch.cat(
            [q.reshape(n, nh * hd), k.reshape(n, nkv * hd), qkv.narrow(1, (nh + nkv) * hd, nkv * hd)], 1
        )

    def _optional_projection(self, weight: Tensor | None) -> Projection | None:
        return None if weight is None else self._projection(weight.t())

    def _experts(self, x: Tensor, experts: moe.ExpertWeights) -> Tensor:
        """A mixture-of-experts MLP on normed ``x`` [n, h] -> its output, all-reduced over TP; the chosen
        experts go to :attr:`routing` when it records."""
        moe_arch = self.arch.moe
        assert moe_arch is not None
        probs, chosen = moe.route(x, experts.router, moe_arch.top_k, moe_arch.norm_topk_prob)
        if self.routing is not None:
            self.routing.append(chosen)
        return self._all_reduce(moe.experts_mlp(x, probs, chosen, experts.w13, experts.w2))

    def _mlp_block(self, layer: _LayerWeights, x: Tensor) -> Tensor:
        if layer.experts is not None:
            return x + self._experts(_rms_norm(x, layer.post_norm, self.arch.norm_eps), layer.experts)
        assert layer.gate_up is not None and layer.down is not None
        gate_up = linear(_rms_norm(x, layer.post_norm, self.arch.norm_eps), layer.gate_up, None, False)
        # one pass, bitwise ATen's silu(gate) * up (csrc/decode_cpu.cpp), where that is two over a [n, f] temporary
        return self._project_add(x, fused.silu_mul(gate_up), layer.down, decoding=False)

    def _norm(self, x: Tensor, weight: Tensor, decoding: bool) -> Tensor:
        """RMSNorm: a decode step (a few rows) runs the fused kernel; longer forwards keep the ATen spelling
        that is bitwise megatron's."""
        if decoding:
            return fused.rms_norm(x, weight, self.arch.norm_eps)
        return _rms_norm(x, weight, self.arch.norm_eps)
