"""A Hugging Face safetensors folder as megatron's full (TP=1) state: the one HF weight load of every
engine (actor, critic body, reward model, DPO policy) that starts from an HF folder.

Every rank reads the whole folder, which suits small models; large ones are converted once with
``mcore-rl convert hf-to-mcore`` and loaded shard by shard (``TrainEngine.load_model``).
"""

from __future__ import annotations

import os

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import STORABLE_DTYPES
from mcore_rl.engine.hf.mapping import (
    ConvertError,
    check_convertible,
    hf_shapes,
    optional_hf_names,
    tensor_maps,
    to_full,
)
from mcore_rl.engine.hf.safetensors_io import SafetensorsReader


def load_hf_full_state(
    path: str, arch: ModelArch, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The megatron full state (fused QKV and gate/up; a classifier's ``score`` as the value head) of the HF
    folder ``path``, checked against ``arch`` from the headers first, cast to ``dtype`` (None: as stored)."""
    reader = SafetensorsReader(path)
    check_hf_weights(arch, reader, dtype)
    state = {m.full_name: to_full(arch, m, [reader.get(n) for n in m.hf_names]) for m in tensor_maps(arch)}
    return state if dtype is None else {name: t.to(dtype) for name, t in state.items()}


def check_hf_weights(arch: ModelArch, reader: SafetensorsReader, dtype: torch.dtype | None) -> torch.dtype:
    """Every tensor the config implies is present with that shape; returns the dtype to store."""
    check_convertible(arch)  # a run's own HF load too: the config's field named, not a stray tensor
    expected: dict[str, tuple[int, ...]] = {}
    for tensor_map in tensor_maps(arch):
        expected.update(zip(tensor_map.hf_names, hf_shapes(arch, tensor_map), strict=True))
    config = os.path.join(reader.directory, "config.json")
    for name, shape in expected.items():
        info = reader.infos.get(name)
        if info is None:
            raise ConvertError(f"{reader.directory}: tensor {name} is missing, but {config} implies it")
        if info.shape != shape:
            raise ConvertError(
                f"{os.path.join(reader.directory, info.file)}: {name} has shape {list(info.shape)}, "
                f"but {config} implies {list(shape)} ({_shape_fields(arch)})"
            )
    if arch.tie_word_embeddings and "lm_head.weight" in reader.infos:
        _check_tied_copy(reader, config)
    unexpected = sorted(set(reader.infos) - set(expected) - optional_hf_names(arch))
    if unexpected:
        file = os.path.join(reader.directory, reader.infos[unexpected[0]].file)
        raise ConvertError(
            f"{file}: tensor {unexpected[0]} (and {len(unexpected) - 1} more) has no place in the model "
            f"{config} describes ({_shape_fields(arch)})"
        )
    if dtype is not None:
        return dtype
    dtypes = sorted({str(reader.infos[n].dtype) for n in expected})
    if len(dtypes) > 1:
        raise ConvertError(f"{reader.directory}: weights mix dtypes {dtypes}; choose one with --dtype")
    stored = reader.infos[next(iter(expected))]
    if stored.dtype not in STORABLE_DTYPES:
        raise ConvertError(
            f"{os.path.join(reader.directory, stored.file)}: weights are {stored.dtype}, which a checkpoint "
            "does not store; choose --dtype bf16, fp16 or fp32"
        )
    return stored.dtype


def _shape_fields(arch: ModelArch) -> str:
    fields = (
        f"num_hidden_layers={arch.num_layers}, hidden_size={arch.hidden_size}, "
        f"intermediate_size={arch.ffn_hidden_size}, num_attention_heads={arch.num_attention_heads}, "
        f"num_key_value_heads={arch.num_query_groups}, head_dim={arch.head_dim}, vocab_size={arch.vocab_size}, "
        f"tie_word_embeddings={arch.tie_word_embeddings}"
    )
    if arch.moe is not None:
        fields += f", num_experts={arch.moe.num_experts}, moe_intermediate_size={arch.moe.ffn_hidden_size}"
    return fields


def _check_tied_copy(reader: SafetensorsReader, config: str) -> None:
    """A tied config whose folder also stores ``lm_head.weight``: a copy of the embedding is fine, another
    tensor is a trained head transformers would load apart (untying the two) where the tied model drops it."""
    head, embedding = reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")
    if head.shape != embedding.shape or not torch.equal(head, embedding):
        file = os.path.join(reader.directory, reader.infos["lm_head.weight"].file)
        raise ConvertError(
            f"{file}: lm_head.weight differs from model.embed_tokens.weight, but {config} says "
            "tie_word_embeddings=true (transformers loads the head apart): set it to false, or save the model tied"
        )
