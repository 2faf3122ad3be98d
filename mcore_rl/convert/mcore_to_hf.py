"""megatron-core distributed checkpoint (any saved TP/PP/VPP) -> HF folder, streamed tensor by tensor.

Data flow (one process; under torchrun only rank 0 works)::

    .metadata --> for each full-state tensor, in HF order:
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
from mcore_rl.convert.dist_layout import checkpoint_location
from mcore_rl.convert.memory import release_freed_memory
from mcore_rl.convert.output import HF_SIDE_FILES, conversion_output, copy_side_files
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import HF_ASSETS_DIR, STORABLE_DTYPES, ModelCheckpointInfo
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
from mcore_rl.engine.hf.score_head import arch_of_config, hf_config_of
from mcore_rl.io.errors import note
from mcore_rl.io.inputs import check_input_tree, input_file, read_json_object
from mcore_rl.parallel.launch_env import current_rank

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' historical default ("5GB")


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
        hf_config = read_json_object(str(input_file(options.hf_config_from, "config.json")), ConvertError)
        side_files_from = options.hf_config_from
    else:
        info = ModelCheckpointInfo.read(ckpt)
        if info is None:
            raise ConvertError(
                f"{ckpt}: no mcore_rl_model.json; pass --hf-config-from with the model's HF folder"
            )
        hf_config, side_files_from = info.hf_config, os.path.join(ckpt, HF_ASSETS_DIR)
    arch = arch_of_config(hf_config, options.hf_config_from or os.path.join(ckpt, "mcore_rl_model.json"))
    check_convertible(arch)
    return _Source(arch, hf_config, DistCheckpointReader(ckpt), side_files_from)


def _region(arch: ModelArch, tensor_map: TensorMap, reader: DistCheckpointReader) -> Region:
    """The stored box holding ``tensor_map``'s full-state tensor, checked against the config."""
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
    vocab_ok = key.endswith("word_embeddings.weight") or key == "output_layer.weight"
    fits = len(size) == len(expected) and all(
        s == e or (vocab_ok and i == 0 and s >= e)
        for i, (s, e) in enumerate(zip(size, expected, strict=True))
    )
    if not fits:
        raise ConvertError(
            f"{reader.directory}: {key} has shape {list(size)}, the config implies {list(expected)}"
            + (" (rows may be padded)" if vocab_ok else "")
        )
    prefix = len(where.prefix_shape)
    return Region(key, where.prefix_offsets + (0,) * len(shape), (1,) * prefix + tuple(shape))


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
