"""Hugging Face <-> megatron "full state" names and tensor transforms for the Llama family.

Pure tensor code (no files, no process groups). The full state is defined in ``mcore_rl.engine.weights``:
TP=1 megatron tensors with global layer numbers and the real vocabulary. Llama 2/3, Qwen2, Qwen3 and
Mistral share HF's Llama naming; they differ only in the q/k/v biases (Qwen2), the per-head q/k norms
(Qwen3's ``q_norm``/``k_norm``, megatron's ``q_layernorm``/``k_layernorm``) and tied embeddings, which
:class:`~mcore_rl.engine.arch.ModelArch` already records. Every transform is a reshape/concatenation,
so HF -> full -> HF is bit-exact.

Mixture-of-experts layers (Qwen3-MoE, Mixtral) hold a router and one SwiGLU MLP per expert, named per expert
in HF checkpoints as the hub ships them (transformers 5 fuses the experts in memory and splits them again on
save)::

    Qwen3-MoE  model.layers.{i}.mlp.gate.weight               -> decoder.layers.{i}.mlp.router.weight
               model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj.weight
                                                              -> ...mlp.experts.local_experts.{e}.linear_fc1
               model.layers.{i}.mlp.experts.{e}.down_proj.weight -> ...local_experts.{e}.linear_fc2.weight
    Mixtral    model.layers.{i}.block_sparse_moe.gate.weight  -> decoder.layers.{i}.mlp.router.weight
               ...block_sparse_moe.experts.{e}.w1 (gate), w3 (up) / w2 (down)

One :class:`TensorMap` ties a full-state tensor to the HF tensors it is made of; :func:`tensor_maps`
lists them in checkpoint order (embedding, layers in order, final norm, output layer), which is also the
order the streaming converters read and write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.score_head import has_score_head
from mcore_rl.io.errors import InputError
from mcore_rl.parallel.sharding import expert_param_name, is_expert_param


class ConvertError(InputError):
    """Input a conversion cannot use; the message names the file or field at fault."""


# How a full-state tensor is made of HF tensors.
COPY = "copy"  # one HF tensor, same layout
QKV = "qkv"  # q, k, v projections fused per query group
GATE_UP = "gate_up"  # [gate; up]


@dataclass(frozen=True)
class TensorMap:
    full_name: str
    """Megatron full-state name, e.g. ``decoder.layers.3.self_attention.linear_qkv.weight``."""
    hf_names: tuple[str, ...]
    """The HF tensors, in the order the transform takes them."""
    kind: str
    """:data:`COPY`, :data:`QKV` or :data:`GATE_UP`."""


def tensor_maps(arch: ModelArch) -> list[TensorMap]:
    """Every full-state tensor of ``arch`` with its HF sources, in checkpoint order."""
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COPY)]
    for i in range(arch.num_layers):
        maps.extend(_layer_maps(arch, i))
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), COPY))
    if has_score_head(arch):  # a sequence classifier: its score head is the value head
        maps.append(TensorMap("output_layer.weight", ("score.weight",), COPY))
    elif not arch.tie_word_embeddings:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), COPY))
    return maps


def _layer_maps(arch: ModelArch, i: int) -> list[TensorMap]:
    full, hf = f"decoder.layers.{i}", f"model.layers.{i}"
    attn = f"{hf}.self_attn"
    maps = [
        TensorMap(f"{full}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",), COPY),
        TensorMap(
            f"{full}.self_attention.linear_qkv.weight",
            (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
            QKV,
        ),
    ]
    if arch.qkv_bias:
        maps.append(
            TensorMap(
                f"{full}.self_attention.linear_qkv.bias",
                (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"),
                QKV,
            )
        )
    if arch.qk_norm:
        maps += [
            TensorMap(f"{full}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), COPY),
            TensorMap(f"{full}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), COPY),
        ]
    maps += [
        TensorMap(f"{full}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), COPY),
        TensorMap(f"{full}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",), COPY),
    ]
    if arch.is_moe_layer(i):
        return maps + _moe_maps(arch, i)
    return [
        *maps,
        TensorMap(
            f"{full}.mlp.linear_fc1.weight",
            (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
            GATE_UP,
        ),
        TensorMap(f"{full}.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",), COPY),
    ]


# HF's names of a MoE block: (block, router, gate, up, down) per family
_MOE_NAMES = {
    "qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


def _moe_maps(arch: ModelArch, i: int) -> list[TensorMap]:
    """Router, then each expert's fc1 and fc2, in expert order (see the module docstring)."""
    assert arch.moe is not None
    block, router, gate, up, down = _MOE_NAMES[arch.family]
    hf = f"model.layers.{i}.{block}"
    maps = [TensorMap(f"decoder.layers.{i}.mlp.router.weight", (f"{hf}.{router}.weight",), COPY)]
    for e in range(arch.moe.num_experts):
        expert = f"{hf}.experts.{e}"
        maps += [
            TensorMap(
                expert_param_name(i, e, "linear_fc1.weight"),
                (f"{expert}.{gate}.weight", f"{expert}.{up}.weight"),
                GATE_UP,
            ),
            TensorMap(expert_param_name(i, e, "linear_fc2.weight"), (f"{expert}.{down}.weight",), COPY),
        ]
    return maps


def check_convertible(arch: ModelArch) -> None:
    """Raise :class:`ConvertError` for configs ``ModelArch`` accepts but the weight mapping cannot carry."""
    cfg = arch.extra
    if arch.family in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        # HF Llama and Qwen3 (MoE too) then also have an o_proj bias, which megatron's add_qkv_bias does not model.
        raise ConvertError(
            f"attention_bias=true is not supported for {arch.family.capitalize()} (o_proj bias has no "
            "megatron slot)"
        )


def hf_shapes(arch: ModelArch, tensor_map: TensorMap) -> list[tuple[int, ...]]:
    """Shapes the HF tensors of ``tensor_map`` must have under ``arch`` (for validating inputs)."""
    h, d = arch.hidden_size, arch.head_dim
    q_rows, kv_rows = arch.num_attention_heads * d, arch.num_query_groups * d
    name = tensor_map.full_name
    ffn = arch.moe.ffn_hidden_size if arch.moe is not None and is_expert_param(name) else arch.ffn_hidden_size
    if name.endswith("mlp.router.weight"):
        assert arch.moe is not None
        return [(arch.moe.num_experts, h)]
    if tensor_map.kind == QKV:
        tail = (h,) if name.endswith("weight") else ()
        return [(q_rows, *tail), (kv_rows, *tail), (kv_rows, *tail)]
    if tensor_map.kind == GATE_UP:
        return [(ffn, h)] * 2
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(d,)]  # one norm over head_dim, shared by every head
    if name.endswith("layernorm.weight"):
        return [(h,)]
    if name.endswith("linear_proj.weight"):
        return [(h, q_rows)]
    if name.endswith("linear_fc2.weight"):
        return [(h, ffn)]
    if name == "output_layer.weight" and has_score_head(arch):
        return [(1, h)]
    return [(arch.vocab_size, h)]  # embedding / output layer


def full_shape(arch: ModelArch, tensor_map: TensorMap) -> tuple[int, ...]:
    shapes = hf_shapes(arch, tensor_map)
    if tensor_map.kind == COPY:
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def to_full(arch: ModelArch, tensor_map: TensorMap, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """The full-state tensor from its HF tensors (same dtype)."""
    if tensor_map.kind == QKV:
        return fuse_qkv(arch, *hf_tensors)
    if tensor_map.kind == GATE_UP:
        return torch.cat(hf_tensors, dim=0)
    return hf_tensors[0]


def to_hf(arch: ModelArch, tensor_map: TensorMap, full: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`to_full`: the HF tensors, contiguous, in ``tensor_map.hf_names`` order."""
    if tensor_map.kind == QKV:
        return list(split_qkv(arch, full))
    if tensor_map.kind == GATE_UP:
        return [t.contiguous() for t in torch.chunk(full, 2, dim=0)]
    return [full.contiguous()]


def fuse_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [groups*d, ...] -> megatron [groups*(heads/groups + 2)*d, ...].

    megatron stores each query group contiguously as [its q heads; k; v], so TP (which splits whole
    groups) slices dim 0 contiguously. Works for weights ([.., hidden]) and biases alike.
    """
    groups, d = arch.num_query_groups, arch.head_dim
    per_group = arch.num_attention_heads // groups
    tail = q.shape[1:]
    parts = [
        q.reshape(groups, per_group * d, *tail),
        k.reshape(groups, d, *tail),
        v.reshape(groups, d, *tail),
    ]
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * d, *tail)


def split_qkv(arch: ModelArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, d = arch.num_query_groups, arch.head_dim
    per_group = arch.num_attention_heads // groups
    tail = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(groups, (per_group + 2) * d, *tail), [per_group * d, d, d], dim=1)
    return (
        q.reshape(groups * per_group * d, *tail).contiguous(),
        k.reshape(groups * d, *tail).contiguous(),
        v.reshape(groups * d, *tail).contiguous(),
    )


def optional_hf_names(arch: ModelArch) -> set[str]:
    """HF tensors that may be present but carry nothing megatron needs.

    Tied checkpoints sometimes store ``lm_head.weight`` anyway (a copy of the embedding), and older
    transformers saved the rotary ``inv_freq`` buffers.
    """
    names = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(arch.num_layers)}
    if arch.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def check_finite(tensor: torch.Tensor, name: str, where: str, allow: bool) -> None:
    """NaN/Inf in a weight: refused (naming the tensor and file), or one warning line with ``allow``."""
    if not tensor.is_floating_point():
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad == 0:
        return
    message = f"{where}: tensor {name} holds {bad} NaN/Inf value(s) of {tensor.numel()}"
    if not allow:
        raise ConvertError(f"{message}; pass --allow-nonfinite to convert it anyway")
    from mcore_rl.io.errors import note

    note(f"warning: {message}; converted as is (--allow-nonfinite)")
