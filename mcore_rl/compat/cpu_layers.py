"""Faster stand-ins for the blocks of megatron-core's local layer spec, which is what runs on a CPU.

The local spec builds every block from small torch ops; on a CPU, where a small model's GEMMs are only
about half of a training step, the elementwise passes around them are most of the rest (issue 17). The
stand-ins compute the same thing with fewer passes, keep megatron's parameters and state-dict keys, and
hand anything they do not cover back to megatron's own code. The forwards of the norm, SwiGLU and rotary
are bitwise megatron's; plain causal attention runs torch's fused kernel, which sums in another order (within
fp32 rounding of megatron's), and the rollout decoder calls that same kernel on the same operands, so the two
still match exactly at TP1 (tests/engine/rollout/test_megatron_parity.py holds them to it). The backwards agree
to fp32 rounding:

- :class:`SdpaDotProductAttention`: megatron's core attention, with
  ``torch.nn.functional.scaled_dot_product_attention`` for plain causal attention, padded or packed rows
  (shared-prompt rows: ``ops/row_attention.py``'s fused kernel), and under context parallelism, which
  megatron's local attention refuses, causal attention over the CP group (``compat/context_attention.py``);
- :func:`bias_swiglu_impl`: megatron's fused-SwiGLU slot (``bias_activation_fusion``) filled with
  :func:`mcore_rl.ops.train_blocks.swiglu`;
- :class:`FusedRMSNorm`: ``torch.nn.RMSNorm`` with :func:`mcore_rl.ops.train_blocks.rms_norm`;
- :func:`apply_rotary_pos_emb`: megatron's rotary dispatcher with :func:`mcore_rl.ops.train_blocks.rope`
  for its unfused non-interleaved case.

:func:`local_spec` swaps the attention into a local layer spec; ``compat.megatron_cpu`` installs the
other three along with its CPU patches.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.compat.shared_prefix_attention import token_positions
from mcore_rl.ops import train_blocks


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same ``weight``) whose fp32 forward and backward take fewer passes."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or self.eps is None:  # no affine weight / default eps: torch's own norm
            return super().forward(x)
        return train_blocks.rms_norm(x, self.weight, self.eps)


def _dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class SdpaDotProductAttention(_dot_product_attention()):  # type: ignore[misc]
    """megatron's ``DotProductAttention``, with torch's fused kernel for plain causal attention: padded rows
    (``sbhd``) and packed ones (``thd``, which megatron's local attention refuses); explicit masks, windows
    and the like stay megatron's. Under context parallelism (which megatron's local attention refuses at
    construction) causal attention, windowed or not, over the CP group: ``compat/context_attention.py``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        cp = config.context_parallel_size
        config.context_parallel_size = 1  # megatron's assertion: "only supported by TEDotProductAttention"
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        self.cp_group: Any = None
        """The CP group keys and values are gathered over (None without context parallelism)."""
        self.cp_window: int | None = None
        """This layer's sliding window (megatron's ``window_size[0]``) under context parallelism."""
        if cp > 1:
            self._init_context_parallel(kwargs.get("pg_collection"))

    def _init_context_parallel(self, pg_collection: Any) -> None:
        from megatron.core.transformer.utils import is_layer_window_attention

        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        config = self.config
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            self.cp_window = config.window_size[0]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if self.cp_group is not None:
            return self._context_parallel_forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed_forward(query, key, value, attention_mask, attn_mask_type, packed_seq_params)
        if packed_seq_params is None and self._plain_causal(attention_mask, attn_mask_type, attention_bias):
            return self._padded_forward(query, key, value)
        return super().forward(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        )

    def _padded_forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal attention over whole rows (megatron's ``sbhd``: query [s, b, heads, d], key / value
        [s, b, groups, d]) with torch's fused kernel: one pass instead of megatron's baddbmm -> mask ->
        softmax -> bmm, each with its own backward (issue 17). The rollout decoder's multi-token forward
        calls the same kernel on the same shapes (``engine/rollout/decoder.py``), so the two still agree
        bitwise at TP1. [s, b, heads * d]."""
        # Contiguous [b, heads, s, d]: the kernel's rounding follows the operands' strides, and the decoder
        # hands it contiguous operands too.
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _packed_forward(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Any, mask_type: Any, packed: Any
    ) -> Tensor:
        """Rows packed end to end (megatron's ``thd``: query/key/value [T, heads, d], boundaries in
        ``cu_seqlens``): causal attention within each row, what TE's fused attention computes on a GPU and
        megatron's own local attention refuses. [T, heads * d]."""
        if not self._plain_causal(mask, mask_type, None):
            raise ValueError(
                "packed sequences (model.use_remove_padding) on the local layer spec need causal attention "
                "without an explicit mask, window, dropout or context parallelism"
            )
        if (
            getattr(packed, "token_home", None) is not None
        ):  # shared prompts (engine/packing/shared_prefix.py)
            from mcore_rl.compat.shared_prefix_attention import row_attention

            return row_attention(query, key, value, packed, self.softmax_scale)
        cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
        bounds = cu.tolist()
        gqa = key.shape[1] != query.shape[1]
        rows = []
        for start, end in itertools.pairwise(bounds):
            # [L, heads, d] -> [1, heads, L, d]
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            )
            rows.append(out[0].transpose(0, 1))
        return torch.cat(rows).reshape(query.shape[0], self.hidden_size_per_partition)

    def _context_parallel_forward(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Any, mask_type: Any, bias: Any, packed: Any
    ) -> Tensor:
        """This CP rank's share of causal attention (``compat/context_attention.py``): padded rows (``sbhd``,
        query [s / cp, b, heads, d]) or packed ones (``thd``, [T / cp, heads, d], segments from the padded
        ``cu_seqlens``), keys and values gathered over the CP group. [s / cp, b, heads * d] or [T / cp, ...]."""
        from megatron.core.transformer.enums import AttnMaskType

        from mcore_rl.compat.context_attention import context_attention, gather_sequence

        config = self.config
        if not (
            mask is None
            and bias is None
            and (mask_type or self.attn_mask_type) == AttnMaskType.causal
            and getattr(config, "softmax_type", "vanilla") == "vanilla"
            and (config.attention_dropout == 0.0 or not self.training)
        ):
            raise ValueError(
                "context parallelism on the local layer spec needs causal attention without an explicit mask, "
                "attention bias, softmax variant or dropout"
            )
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        if packed is not None and packed.qkv_format == "thd":
            if getattr(packed, "token_home", None) is not None:
                raise ValueError("model.share_prompt_prefix does not support context parallelism")
            cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            segments = torch.diff(cu).tolist()
            q = query.transpose(0, 1)[None]  # [1, heads, T / cp, d]
            k, v = (
                gather_sequence(t, segments, self.cp_group, 0).transpose(0, 1)[None] for t in (key, value)
            )
        else:
            segments = [query.shape[0] * cp]
            q = query.permute(1, 2, 0, 3)  # [b, heads, s / cp, d]
            k, v = (gather_sequence(t, segments, self.cp_group, 0).permute(1, 2, 0, 3) for t in (key, value))
        out = context_attention(q, k, v, segments, cp, rank, self.softmax_scale, self.cp_window)
        if packed is not None and packed.qkv_format == "thd":
            return out[0].transpose(0, 1).reshape(query.shape[0], self.hidden_size_per_partition)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _plain_causal(self, mask: Any, mask_type: Any, bias: Any) -> bool:
        """Causal attention and nothing else: no explicit mask or bias, window, softmax variant, active
        dropout or context parallelism."""
        from megatron.core.transformer.enums import AttnMaskType

        config = self.config
        return (
            mask is None
            and bias is None
            and (mask_type or self.attn_mask_type) == AttnMaskType.causal
            and getattr(config, "window_size", None) is None
            and getattr(config, "softmax_type", "vanilla") == "vanilla"
            and (config.attention_dropout == 0.0 or not self.training)
            and self.config.context_parallel_size == 1
        )


def local_spec(spec: Any) -> Any:
    """megatron's local layer spec with :class:`SdpaDotProductAttention` as its core attention."""
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is _dot_product_attention():
        attention.core_attention = SdpaDotProductAttention
    return spec


def bias_swiglu_impl(original: Any) -> Any:
    """megatron's fused-SwiGLU entry (``bias_activation_fusion``) with :func:`train_blocks.swiglu` for the
    bias-free case; megatron's own is ``torch.compile``d, which on a CPU compiles C++ at first use."""

    def dispatch(x: Tensor, bias: Tensor | None, *args: Any, **kwargs: Any) -> Tensor:
        # (fp8_input_store, cpu_offload_input[, activation_func_clamp_value (megatron main)]): any of them set
        # is megatron's own path; what a newer megatron adds is passed through unread
        if bias is None and not any(args) and not any(kwargs.values()):
            return train_blocks.swiglu(x)
        return original(x, bias, *args, **kwargs)

    dispatch._mcore_rl_original = original  # type: ignore[attr-defined]
    return dispatch


def apply_rotary_pos_emb(original: Any) -> Any:
    """megatron's ``apply_rotary_pos_emb`` with :func:`train_blocks.rope` for its unfused bshd case."""

    def dispatch(
        t: Tensor,
        freqs: Tensor,
        config: Any,
        cu_seqlens: Tensor | None = None,
        mscale: float = 1.0,
        cp_group: Any = None,
        **newer: Any,  # what a later megatron passes: max_seqlen= (main), a hint for its fused kernel alone
    ) -> Tensor:
        unknown = [v for k, v in newer.items() if k != "max_seqlen" and v is not None and v is not False]
        plain = (
            not unknown
            and mscale == 1.0
            and not config.apply_rope_fusion
            and not config.rotary_interleaved
            and not config.multi_latent_attention
        )
        positions = token_positions(cu_seqlens)
        if positions is not None:  # shared-prompt packing: positions do not restart per segment
            if not plain or config.context_parallel_size > 1:
                raise ValueError(
                    "model.share_prompt_prefix needs plain non-interleaved rotary without context parallelism"
                )
            return train_blocks.rope(t.unsqueeze(1), freqs[positions]).squeeze(1)  # [T, heads, d]
        if cu_seqlens is None and plain and t.dtype == torch.float32:
            return train_blocks.rope(t, freqs)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **newer)

    dispatch._mcore_rl_original = original  # type: ignore[attr-defined]
    return dispatch
