"""megatron-core distributed checkpoint (any saved TP/PP/VPP) -> HF folder, streamed tensor by tensor.

Data flow (one process; under torchrun only rank 0 works)::

    .metadata --> every stored weight has its place in the config's model, each with the config's shape
              (a vocab tensor's rows: the vocab as megatron pads it), the vocab the checkpoint records
    --> for each full-state tensor, in HF order:
        DCP read of its region (one layer of one key; the real vocab rows only)
        --to_hf()--> q/k/v, gate/up, ... --> StreamingShardWriter (header first, data appended)
    + config.json (from mcore_rl_model.json or --hf-config-from) + tokenizer files

Peak memory is about one full-state tensor and its HF pieces; output shards never sit in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.convert.dcp_io import DistCheckpointReader, Region
from mcore_rl.convert.dist_layout import checkpoint_location, stored_vocab_rows
from mcore_rl.convert.memory import release_freed_memory
from mcore_rl.convert.output import conversion_output
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import HF_ASSETS_DIR, MODEL_INFO_FILE, STORABLE_DTYPES, ModelCheckpointInfo
from mcore_rl.engine.hf.mapping import (
    ConvertError,
    TensorMap,
    check_convertible,
    check_finite,
    full_shape,
    hf_shapes,
    tensor_maps,
    to_hf,
)
from mcore_rl.engine.hf.safetensors_io import OutputTensor, StreamingShardWriter
from mcore_rl.engine.hf.score_head import arch_of_config, has_score_head, hf_config_of
from mcore_rl.io.errors import note
from mcore_rl.io.inputs import check_input_tree, input_file, read_json_object
from mcore_rl.io.side_files import HF_SIDE_FILES, copy_side_files
from mcore_rl.parallel.launch_env import current_rank
from mcore_rl.parallel.sharding import ShardKind, shard_kind

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' historical default ("5GB")
OPTIMIZER_PREFIX = "optimizer."
"""Stored keys of the optimizer state a training checkpoint holds beside the model (megatron's
``optimizer.state.*``, ``optimizer.distributed.*``): no weights, so not converted."""


@dataclass(frozen=True)
class McoreToHfOptions:
    ckpt: str
    """megatron distributed checkpoint folder (ours or any trainer's model checkpoint)."""
    out: str
    """HF folder to create."""
    hf_config_from: str | None = None
    """HF folder whose config.json (and tokenizer files) describe the model; needed for checkpoints
    without ``mcore_rl_model.json``, and overrides it otherwise."""
    dtype: torch.dtype | None = None
    """Output dtype; None keeps the stored one."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest safetensors shard; one tensor larger than it gets a shard of its own."""
    overwrite: bool = False
    """Replace a non-empty ``out`` (never an input, the current directory or home)."""
    allow_nonfinite: bool = False
    """Convert weights holding NaN/Inf with a warning instead of refusing them."""


@dataclass(frozen=True)
class _Source:
    arch: ModelArch
    hf_config: dict[str, Any]
    config_file: str
    """The file ``hf_config`` was read from (named in errors)."""
    reader: DistCheckpointReader
    side_files_from: str


def _open_checkpoint(options: McoreToHfOptions) -> _Source:
    ckpt = options.ckpt
    if not ckpt or not os.path.isdir(ckpt):
        raise ConvertError(f"--ckpt {ckpt!r} is not a folder")
    check_input_tree(ckpt, "--ckpt")
    marker = os.path.join(ckpt, "metadata.json")
    if not os.path.isfile(marker):
        raise ConvertError(f"{marker}: no such file; --ckpt {ckpt} is not a megatron distributed checkpoint")
    backend = read_json_object(marker, ConvertError).get("sharded_backend")
    if backend != "torch_dist":
        raise ConvertError(f"{marker}: sharded_backend={backend!r}, only 'torch_dist' is supported")
    if options.hf_config_from is not None:
        if not os.path.isdir(options.hf_config_from):
            raise ConvertError(f"--hf-config-from {options.hf_config_from!r} is not a folder")
        config_file = str(input_file(options.hf_config_from, "config.json"))
        hf_config = read_json_object(config_file, ConvertError)
        side_files_from = options.hf_config_from
    else:
        info = ModelCheckpointInfo.read(ckpt)
        if info is None:
            raise ConvertError(
                f"{ckpt}: no {MODEL_INFO_FILE}; pass --hf-config-from with the model's HF folder"
            )
        hf_config, side_files_from = info.hf_config, os.path.join(ckpt, HF_ASSETS_DIR)
        config_file = os.path.join(ckpt, MODEL_INFO_FILE)
    arch = arch_of_config(hf_config, options.hf_config_from or config_file)
    check_convertible(arch)
    if options.hf_config_from is not None:
        _check_recorded_vocab(ckpt, arch, config_file)
    return _Source(arch, hf_config, config_file, DistCheckpointReader(ckpt), side_files_from)


def _check_recorded_vocab(ckpt: str, arch: ModelArch, config_file: str) -> None:
    """A given config's vocab is the one the checkpoint records (when it has our metadata): padded rows hold a
    smaller vocab too, whose conversion would drop real tokens."""
    info = ModelCheckpointInfo.read(ckpt)
    if info is not None and info.arch.vocab_size != arch.vocab_size:
        raise ConvertError(
            f"{config_file}: vocab_size={arch.vocab_size}, but {os.path.join(ckpt, MODEL_INFO_FILE)} records "
            f"vocab_size={info.arch.vocab_size} for this checkpoint"
        )


def _region(arch: ModelArch, tensor_map: TensorMap, reader: DistCheckpointReader) -> Region:
    """The stored box holding ``tensor_map``'s full-state tensor, checked against the config: the shape it
    implies, but for a vocab tensor's rows, which may be the vocab padded as megatron pads it at some TP (a
    classifier's [1, hidden] score head is no vocab tensor: never padded). Any TP's padding of a smaller vocab
    can fit too: a given config's vocab is checked against the checkpoint's own record first."""
    where = checkpoint_location(arch, tensor_map.full_name)
    key = where.key
    stored = reader.tensors.get(key)
    if stored is None:
        raise ConvertError(
            f"{reader.directory}: checkpoint has no tensor {key} (needed for {tensor_map.full_name})"
        )
    shape = full_shape(arch, tensor_map)
    expected = (*where.prefix_shape, *shape)
    size = tuple(stored.size)
    score_head = tensor_map.full_name == "output_layer.weight" and has_score_head(arch)
    vocab = shard_kind(tensor_map.full_name, value_head=score_head) is ShardKind.VOCAB
    rows = stored_vocab_rows(arch) if vocab else [expected[0]]
    fits = size[1:] == expected[1:] and size[0] in rows
    if not fits:
        hint = ""
        if vocab:
            hint = f" (rows: vocab_size={arch.vocab_size} as megatron pads it at some TP, one of {rows})"
        elif score_head:
            hint = " (a sequence classifier's score head)"
        raise ConvertError(
            f"{reader.directory}: {key} has shape {list(size)}, the config implies {list(expected)}{hint}"
        )
    prefix = len(where.prefix_shape)
    return Region(key, where.prefix_offsets + (0,) * len(shape), (1,) * prefix + tuple(shape))


def _check_all_used(source: _Source, used: set[str]) -> None:
    """Every stored weight has its place in the config's model (hf-to-mcore refuses leftover HF tensors alike):
    else a tied config would silently drop an untied checkpoint's trained output layer."""
    left = sorted(k for k in source.reader.tensors if k not in used and not k.startswith(OPTIMIZER_PREFIX))
    if not left:
        return
    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
    tied = source.arch.tie_word_embeddings and "output_layer.weight" in left
    raise ConvertError(
        f"{source.reader.directory}: tensor {left[0]}{more} has no place in the model {source.config_file} "
        "describes"
        + (" (tie_word_embeddings=true, but the checkpoint has its own output layer)" if tied else "")
    )


def _output_config(hf_config: dict[str, Any], dtype: torch.dtype, arch: ModelArch) -> dict[str, Any]:
    """The HF config to write: unchanged but for its dtype field (if it has one), set to the weights'
    (a classifier's own config, not its body's), and its ``model_type`` when it had none (an inline
    ``model.hf_config``): transformers' ``AutoModel`` needs it, and our family names are HF's model types."""
    config = hf_config_of(hf_config)
    config.setdefault("model_type", arch.family)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    return config


def convert_mcore_to_hf(options: McoreToHfOptions) -> str:
    """Write the HF folder; returns its path. Under torchrun, ranks other than 0 return at once."""
    output = conversion_output(
        options.out, [options.ckpt, options.hf_config_from], options.overwrite, kind="hf-model"
    )
    if current_rank() != 0:
        return output.path
    source = _open_checkpoint(options)
    arch, reader = source.arch, source.reader
    maps = tensor_maps(arch)
    regions = [_region(arch, m, reader) for m in maps]
    _check_all_used(source, {r.fqn for r in regions})
    stored = reader.tensors[regions[0].fqn].properties.dtype
    if options.dtype is None and stored not in STORABLE_DTYPES:
        raise ConvertError(
            f"{reader.directory}: weights are stored as {stored}; choose --dtype bf16, fp16 or fp32"
        )
    dtype = options.dtype or stored
    outputs = [
        OutputTensor(name, shape, dtype)
        for m in maps
        for name, shape in zip(m.hf_names, hf_shapes(arch, m), strict=True)
    ]
    for name in HF_SIDE_FILES:  # copied at the end: a link out of the folder is refused now, not then
        input_file(source.side_files_from, name, required=False)
    tmp = output.begin()
    try:
        writer = StreamingShardWriter(tmp, outputs, options.max_shard_bytes)
        for tensor_map, region in zip(maps, regions, strict=True):
            (stored_tensor,) = reader.read([region])
            check_finite(stored_tensor, region.fqn, reader.directory, options.allow_nonfinite)
            full = stored_tensor.reshape(full_shape(arch, tensor_map))
            for name, tensor in zip(tensor_map.hf_names, to_hf(arch, tensor_map, full), strict=True):
                writer.add(name, tensor.to(dtype))
            del stored_tensor, full
            release_freed_memory()
        writer.finish()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(_output_config(source.hf_config, dtype, source.arch), f, indent=2, sort_keys=True)
            f.write("\n")
        copied = copy_side_files(source.side_files_from, tmp)
        output.commit()
        if not any(name.startswith("tokenizer") or name in ("vocab.json", "merges.txt") for name in copied):
            # an RL or DPO run checkpoint holds weights only: say so rather than write a folder without one
            note(
                f"{output.path} has no tokenizer: {options.ckpt} holds none; pass --hf-config-from the model "
                "folder the run started from (model.path / model.tokenizer_path) to copy its tokenizer files"
            )
    except BaseException:
        output.abort()
        raise
    return output.path
