"""``mcore-rl convert`` for LoRA runs: a run checkpoint's adapters as a PEFT folder, or a merged HF model.

    mcore-rl convert mcore-to-hf --ckpt RUN/checkpoints/global_step_N --out ADAPTER    # PEFT adapter folder
    mcore-rl convert mcore-to-hf --ckpt RUN/checkpoints/global_step_N --merge-lora --base HF --out MODEL
    mcore-rl convert mcore-to-hf --ckpt ADAPTER --merge-lora --base HF --out MODEL     # a PEFT folder too

A LoRA run checkpoint holds the adapters only (``trainer_state.json`` names their shape); they are read whole
(adapters are small). The merged model is streamed tensor by tensor from the base HF folder
(``W + scale * B A`` per layer, in fp32, then cast), as ``mcore-to-hf`` streams a checkpoint: peak memory is one
base tensor and its adapters.
"""

from __future__ import annotations

import json
import os

import torch

from mcore_rl.convert.dcp_io import DistCheckpointReader, Region
from mcore_rl.convert.dist_layout import checkpoint_location
from mcore_rl.convert.output import conversion_output
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import ModelCheckpointInfo
from mcore_rl.engine.hf.mapping import ConvertError, check_finite, hf_shapes, tensor_maps, to_full, to_hf
from mcore_rl.engine.hf.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_shapes,
    peft_name,
    read_peft_adapter,
    write_peft_adapter,
)
from mcore_rl.engine.hf.safetensors_io import OutputTensor, SafetensorsReader, StreamingShardWriter
from mcore_rl.engine.hf.score_head import arch_of_config
from mcore_rl.engine.hf.state import check_hf_weights
from mcore_rl.engine.lora import merged_weight
from mcore_rl.engine.lora_spec import LoRASpec
from mcore_rl.io.errors import note
from mcore_rl.io.inputs import input_file, read_json_object
from mcore_rl.io.side_files import HF_SIDE_FILES, copy_side_files
from mcore_rl.parallel.launch_env import current_rank

TRAINER_STATE = "trainer_state.json"  # engine/trainer_checkpoint.py's


def is_peft_folder(ckpt: str) -> bool:
    """A PEFT adapter folder (``adapter_config.json``), as written by peft or by ``mcore-to-hf`` itself."""
    return os.path.isfile(os.path.join(ckpt, CONFIG_FILE))


def is_lora_checkpoint(ckpt: str) -> bool:
    """A LoRA run checkpoint (its ``trainer_state.json`` records adapters) or a PEFT adapter folder."""
    if is_peft_folder(ckpt):
        return True
    state = os.path.join(ckpt, TRAINER_STATE)
    return os.path.isfile(state) and read_json_object(state, ConvertError).get("lora") is not None


def checkpoint_adapters(ckpt: str) -> tuple[LoRASpec, ModelArch, dict[str, torch.Tensor]]:
    """(spec, model, full adapters) of a LoRA run checkpoint, each adapter checked against the model."""
    saved = read_json_object(str(input_file(ckpt, TRAINER_STATE)), ConvertError).get("lora")
    if not isinstance(saved, dict):
        raise ConvertError(f"{ckpt}: not a LoRA run checkpoint ({TRAINER_STATE} records no adapters)")
    try:
        spec = LoRASpec(
            saved["rank"], float(saved["alpha"]), tuple(saved["targets"]), float(saved["dropout"])
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{os.path.join(ckpt, TRAINER_STATE)}: lora: {err}") from None
    info = ModelCheckpointInfo.read(ckpt)
    if info is None:
        raise ConvertError(f"{ckpt}: no mcore_rl_model.json")
    arch = info.arch
    reader = DistCheckpointReader(ckpt)
    regions, shapes = [], adapter_shapes(spec, arch)
    for key, shape in shapes.items():
        where = checkpoint_location(arch, key)
        stored = reader.tensors.get(where.key)
        expected = (*where.prefix_shape, *shape)
        if stored is None or tuple(stored.size) != expected:
            found = "absent" if stored is None else f"shape {list(stored.size)}"
            raise ConvertError(
                f"{ckpt}: adapter {where.key} is {found}, {TRAINER_STATE} implies {list(expected)}"
            )
        regions.append(
            Region(where.key, (*where.prefix_offsets, 0, 0), (*(1,) * len(where.prefix_shape), *shape))
        )
    tensors = reader.read(regions)
    return spec, arch, {k: t.reshape(shapes[k]) for k, t in zip(shapes, tensors, strict=True)}


def _base_model(ckpt: str) -> str | None:
    """``model.path`` of the run that wrote ``ckpt`` (its ``config.yaml``), for ``base_model_name_or_path``."""
    config = os.path.join(ckpt, "config.yaml")
    if not os.path.isfile(config):
        return None
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    try:  # untrusted: a config we cannot read only leaves base_model_name_or_path empty
        loaded = OmegaConf.load(config)
    except (OSError, YAMLError, OmegaConfBaseException):
        return None
    model = loaded.get("model") if isinstance(loaded, DictConfig) else None
    path = model.get("path") if isinstance(model, DictConfig) else None
    return path if isinstance(path, str) and path else None


def _recorded_base(source: str) -> str | None:
    """The base model the adapters of ``source`` name: a PEFT folder's ``base_model_name_or_path``, a run
    checkpoint's ``model.path``."""
    if not is_peft_folder(source):
        return _base_model(source)
    try:
        recorded = read_json_object(os.path.join(source, CONFIG_FILE), ConvertError).get(
            "base_model_name_or_path"
        )
    except ConvertError:  # read_peft_adapter has named what is wrong with it
        return None
    return recorded if isinstance(recorded, str) and recorded else None


def _note_other_base(recorded: str | None, base: str) -> None:
    """Adapters merged into another model of the same shapes than the one they name would go unnoticed: the
    merge goes on (a copy of the base elsewhere is fine), saying so where the named base is a folder here."""
    if recorded and os.path.isdir(recorded) and os.path.realpath(recorded) != os.path.realpath(base):
        note(
            f"--base {base} is not the folder the adapters name as their base ({recorded}); merging into --base"
        )


def export_peft(
    ckpt: str, out: str, overwrite: bool, dtype: torch.dtype | None = None, allow_nonfinite: bool = False
) -> str:
    """A LoRA run checkpoint's adapters as a PEFT folder ``out``, cast to ``dtype`` (None: as stored); returns
    its path."""
    output = conversion_output(out, [ckpt], overwrite, kind="lora-adapter")
    if current_rank() != 0:  # under torchrun one rank writes
        return output.path
    spec, _, adapters = checkpoint_adapters(ckpt)
    for key, tensor in adapters.items():
        check_finite(tensor, key, ckpt, allow_nonfinite)
    if dtype is not None:
        adapters = {key: tensor.to(dtype) for key, tensor in adapters.items()}
    staging = output.begin()
    try:
        write_peft_adapter(staging, spec, adapters, _base_model(ckpt))
        output.commit()
    except BaseException:
        output.abort()
        raise
    return output.path


def merge_lora(
    source: str,
    base: str,
    out: str,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    overwrite: bool,
    allow_nonfinite: bool = False,
) -> str:
    """The HF model ``base`` with the adapters of ``source`` (a LoRA run checkpoint or a PEFT folder) merged
    in, written to ``out`` (weights, the base's ``config.json`` and tokenizer files); returns its path.

    NaN/Inf in an adapter or a base weight is refused naming the tensor and its file (``allow_nonfinite``: a
    warning); each merged weight is computed in fp32 and cast once, to ``dtype`` (None: the base's)."""
    output = conversion_output(out, [source, base], overwrite, kind="hf-model")
    if current_rank() != 0:
        return output.path
    config_file = str(input_file(base, "config.json"))
    hf_config = read_json_object(config_file, ConvertError)
    arch = arch_of_config(hf_config, config_file)
    if is_peft_folder(source):
        spec, adapters = read_peft_adapter(source, arch)
        for key, tensor in adapters.items():
            check_finite(tensor, peft_name(key), os.path.join(source, WEIGHTS_FILE), allow_nonfinite)
    else:
        spec, saved_arch, adapters = checkpoint_adapters(source)
        if adapter_shapes(spec, saved_arch) != adapter_shapes(spec, arch):
            raise ConvertError(f"--base {base}: {config_file} is another model than {source} was trained on")
        for key, tensor in adapters.items():
            check_finite(tensor, key, source, allow_nonfinite)
    _note_other_base(_recorded_base(source), base)
    reader = SafetensorsReader(base)
    dtype = check_hf_weights(arch, reader, dtype)
    maps = tensor_maps(arch)
    outputs = [
        OutputTensor(n, s, dtype) for m in maps for n, s in zip(m.hf_names, hf_shapes(arch, m), strict=True)
    ]
    for name in HF_SIDE_FILES:  # a link out of the base folder is refused now, not after the weights
        input_file(base, name, required=False)
    staging = output.begin()
    try:
        writer = StreamingShardWriter(staging, outputs, max_shard_bytes)
        for m in maps:
            hf = [reader.get(n) for n in m.hf_names]
            for name, tensor in zip(m.hf_names, hf, strict=True):
                where = os.path.join(reader.directory, reader.infos[name].file)
                check_finite(tensor, name, where, allow_nonfinite)
            full = to_full(arch, m, hf)
            del hf  # q/k/v and gate/up pieces, once fused
            full = merged_weight(m.full_name, full, adapters, spec, arch, dtype)
            for name, tensor in zip(m.hf_names, to_hf(arch, m, full), strict=True):
                writer.add(name, tensor.to(dtype))
        writer.finish()
        for key in ("dtype", "torch_dtype"):  # the weights' dtype, as mcore-to-hf writes it
            if key in hf_config:
                hf_config[key] = str(dtype).removeprefix("torch.")
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        copy_side_files(base, staging)
        output.commit()
    except BaseException:
        output.abort()
        raise
    return output.path
