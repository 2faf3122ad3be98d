"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors`` with HF module names.

    full state (engine/lora.py)                                   PEFT (peft.PeftModel on the HF base)
    decoder.layers.{i}.self_attention.linear_qkv.lora_A.q_proj.weight  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
    decoder.layers.{i}.mlp.linear_fc2.lora_B.down_proj.weight          base_model.model.model.layers.{i}.mlp.down_proj.lora_B.weight

Tensors are the same matrices (A [r, in], B [out, r], full, TP=1), so the mapping is names only. Reading treats
the folder as untrusted input: a config PEFT's LoRA would apply differently from ours (rsLoRA, DoRA, biases,
per-module ranks, fan_in_fan_out, an ``init_lora_weights`` that rewrites the base) is refused naming the field; every tensor must be one of the model's
adapters, with its shape.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.lora_spec import HF_MODULE, TARGETS, LoRASpec, resolve_targets
from mcore_rl.io.errors import InputError
from mcore_rl.io.inputs import input_file, read_json_object

ADAPTER_DIR = "lora_adapter"
"""A LoRA run's adapter (PEFT format) under ``trainer.default_local_dir``, written at the end beside ``model/``."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model.model.layers."
_FULL = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.\w+\.lora_([AB])\.(\w+)\.weight$")
_PEFT = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def peft_name(key: str) -> str:
    """The PEFT tensor name of full-state adapter ``key``."""
    match = _FULL.match(key)
    if match is None:
        raise KeyError(f"not an adapter name: {key!r}")
    layer, which, projection = match.groups()
    return f"{_PEFT_PREFIX}{layer}.{HF_MODULE[projection]}.{projection}.lora_{which}.weight"


def full_name(name: str) -> str | None:
    """The full-state adapter key of PEFT tensor ``name``; None when it is no LoRA tensor of ours."""
    match = _PEFT.match(name)
    if match is None or match.group(2) not in TARGETS:
        return None
    layer, projection, which = match.groups()
    return f"decoder.layers.{layer}.{TARGETS[projection][0]}.lora_{which}.{projection}.weight"


def adapter_shapes(spec: LoRASpec, arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Every full-state adapter key of ``arch`` under ``spec`` with its full shape."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    sizes = {  # (in, out) of each HF projection
        "q_proj": (arch.hidden_size, q),
        "k_proj": (arch.hidden_size, kv),
        "v_proj": (arch.hidden_size, kv),
        "o_proj": (q, arch.hidden_size),
        "gate_proj": (arch.hidden_size, arch.ffn_hidden_size),
        "up_proj": (arch.hidden_size, arch.ffn_hidden_size),
        "down_proj": (arch.ffn_hidden_size, arch.hidden_size),
    }
    shapes = {}
    for layer in range(arch.num_layers):
        for projection in spec.targets:
            path = TARGETS[projection][0]
            fan_in, fan_out = sizes[projection]
            key = f"decoder.layers.{layer}.{path}"
            shapes[f"{key}.lora_A.{projection}.weight"] = (spec.rank, fan_in)
            shapes[f"{key}.lora_B.{projection}.weight"] = (fan_out, spec.rank)
    return shapes


def adapter_config(spec: LoRASpec, base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json`` for ``spec`` (the fields PEFT's ``LoraConfig`` reads; the rest keep its defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_adapter(
    directory: str, spec: LoRASpec, adapters: dict[str, torch.Tensor], base_model: str | None
) -> None:
    """Write the two files into the existing (staging) folder ``directory``."""
    import json

    from safetensors.torch import save_file

    tensors = {peft_name(k): v.detach().cpu().contiguous() for k, v in sorted(adapters.items())}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(adapter_config(spec, base_model), f, indent=2, sort_keys=True)
        f.write("\n")


_REFUSED: dict[
    str, tuple[Any, ...]
] = {  # field -> the values under which PEFT's LoRA computes what ours does
    "use_rslora": (False, None),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none",),
    "modules_to_save": (None,),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    # pissa*, olora, corda, loftq, lora_ga rewrite the base as W - scale * B0 A0 (recomputed by peft on load),
    # mica is a variant with another forward; these leave W as it is (peft 0.21's LoraLayer.update_layer)
    "init_lora_weights": (True, False, "gaussian", "orthogonal", "eva"),
}
_WHY = {  # fields whose refusal needs a reason and a way out
    "init_lora_weights": "peft applies such an adapter to a base it rewrites on load; save it as plain LoRA "
    "(peft's save_pretrained(..., path_initial_model_for_weight_conversion=INIT_DIR))"
}


def read_peft_spec(directory: str) -> LoRASpec:
    """The :class:`LoRASpec` of a PEFT adapter folder; what our adapters cannot carry is refused naming the
    file and the field."""
    path = str(input_file(directory, CONFIG_FILE))
    config = read_json_object(path)
    if config.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type={config.get('peft_type')!r}, only LORA adapters load")
    for field, allowed in _REFUSED.items():
        value = config.get(field, allowed[0])
        if type(value) not in {type(a) for a in allowed} or value not in allowed:  # 1 is no True here
            why = f"; {_WHY[field]}" if field in _WHY else ""
            raise InputError(f"{path}: {field}={value!r} is not supported (allowed: {list(allowed)}){why}")
    targets = config.get("target_modules")
    try:
        names = resolve_targets(targets if isinstance(targets, (str, list)) else [], key="target_modules")
        return LoRASpec(
            rank=config.get("r"),  # type: ignore[arg-type]
            alpha=float(config.get("lora_alpha", 8)),
            targets=names,
            dropout=float(config.get("lora_dropout", 0.0)),
        )
    except (TypeError, ValueError) as err:
        message = str(err)
        for ours, theirs in _FIELDS.items():  # the config's own field names
            message = message.replace(ours, theirs)
        raise InputError(f"{path}: {message}") from None


_FIELDS = {
    "model.lora_rank": "r",
    "model.lora_alpha": "lora_alpha",
    "model.lora_dropout": "lora_dropout",
    "model.target_modules": "target_modules",
}


def read_peft_adapter(directory: str, arch: ModelArch) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """``(spec, full-state adapters)`` of a PEFT folder for a model ``arch``: every adapter the spec implies
    present with its shape, no other tensor."""
    spec = read_peft_spec(directory)
    file = str(input_file(directory, WEIGHTS_FILE))
    tensors = _read_safetensors(file)
    expected = adapter_shapes(spec, arch)
    found: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = full_name(name)
        if key is None or key not in expected:
            raise InputError(f"{file}: tensor {name} is no adapter of this model ({_targets_text(spec)})")
        if tuple(tensor.shape) != expected[key]:
            raise InputError(
                f"{file}: {name} has shape {list(tensor.shape)}, the model needs {list(expected[key])}"
            )
        found[key] = tensor
    missing = sorted(set(expected) - set(found))
    if missing:
        raise InputError(
            f"{file}: no tensor {peft_name(missing[0])} ({len(missing)} adapters missing), but {CONFIG_FILE} implies it"
        )
    return spec, found


def _read_safetensors(file: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as err:
        raise InputError(f"{file}: not a readable safetensors file ({err})") from None


def _targets_text(spec: LoRASpec) -> str:
    return f"target_modules {list(spec.targets)}, r={spec.rank}"


def check_same_adapters(directory: str, spec: LoRASpec, ours: LoRASpec) -> None:
    """The PEFT folder's adapters (``spec``) are the run's: same rank, alpha and targets (its dropout may
    differ: it only acts while training)."""
    config = os.path.join(directory, CONFIG_FILE)
    for field, mine, theirs in (
        ("r", ours.rank, spec.rank),
        ("lora_alpha", ours.alpha, spec.alpha),
        ("target_modules", sorted(ours.targets), sorted(spec.targets)),
    ):
        if mine != theirs:
            raise InputError(f"{config}: {field}={theirs!r}, the run's model section says {mine!r}")


def load_peft_adapter(engine: Any, directory: str) -> None:
    """Collective: a PEFT adapter folder into a LoRA :class:`~mcore_rl.engine.train_engine.TrainEngine`
    (``model.lora_adapter_path``: training continues from it); its rank, alpha and targets must be the run's."""
    from mcore_rl.engine.lora import load_adapter_state

    ours: LoRASpec | None = engine.options.lora
    if ours is None:
        raise InputError(f"model.lora_adapter_path={directory}: needs model.lora_rank > 0")
    spec, adapters = read_peft_adapter(directory, engine.arch)
    check_same_adapters(directory, spec, ours)
    load_adapter_state(engine.chunks, adapters, engine.arch, engine.ctx, directory)
    engine.optimizer.reload_model_params()  # bf16: the fp32 main params follow


def save_peft_adapter(engine: Any, directory: str, base_model: str | None) -> None:
    """Collective: the adapters of a LoRA :class:`~mcore_rl.engine.train_engine.TrainEngine` as a PEFT folder
    (rank 0 writes it; it replaces only an earlier adapter folder of ours)."""
    from mcore_rl.engine.lora import gather_adapter_state
    from mcore_rl.io.output import OutputFolder

    spec: LoRASpec | None = engine.options.lora
    if spec is None:
        raise ValueError("save_peft_adapter: the engine has no LoRA adapters")
    adapters = gather_adapter_state(engine.chunks, engine.arch, engine.ctx)
    if engine.ctx.rank != 0:
        return
    output = OutputFolder.plan(directory, flag="LoRA adapter folder", replace_ours=True, kind="lora-adapter")
    staging = output.begin()
    try:
        write_peft_adapter(staging, spec, adapters, base_model)
    except BaseException:
        output.abort()
        raise
    output.commit()
