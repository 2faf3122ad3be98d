"""PEFT adapter folders (``engine/hf/peft.py``): our names <-> peft's, a written folder reads back tensor for
tensor, and what our adapters cannot carry, or a folder that is not the model's, is refused in one line naming
the file and the field or tensor. A resume with LoRA from a checkpoint saved without it names its file.
``mcore-to-hf`` of LoRA checkpoints (``convert/peft.py``): ``--merge-lora`` refuses NaN/Inf and merges in fp32
straight to ``--dtype``; a run checkpoint's PEFT export honours ``--dtype``; a PEFT folder without
``--merge-lora`` is told what it needs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.cli import main
from mcore_rl.engine.hf.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_shapes,
    full_name,
    peft_name,
    read_peft_adapter,
    write_peft_adapter,
)
from mcore_rl.engine.lora_spec import LoRASpec, resolve_targets
from mcore_rl.engine.trainer_checkpoint import TRAINER_STATE_FILE, check_lora_matches
from mcore_rl.io.errors import InputError
from tests.convert.hf_models import save_hf_model
from tests.models import tiny_arch

SPEC = LoRASpec(rank=4, alpha=8.0, targets=resolve_targets(["q_proj", "v_proj", "down_proj"]))


def _adapters(spec: LoRASpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=generator) for k, s in adapter_shapes(spec, tiny_arch("llama")).items()
    }


def _written(tmp_path, spec: LoRASpec = SPEC) -> tuple[str, dict[str, torch.Tensor]]:
    folder, adapters = tmp_path / "adapter", _adapters(spec)
    folder.mkdir()
    write_peft_adapter(str(folder), spec, adapters, "/models/base")
    return str(folder), adapters


def test_names_map_both_ways() -> None:
    key = "decoder.layers.3.self_attention.linear_qkv.lora_B.k_proj.weight"
    assert peft_name(key) == "base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"
    assert full_name(peft_name(key)) == key
    down = "decoder.layers.0.mlp.linear_fc2.lora_A.down_proj.weight"
    assert full_name(peft_name(down)) == down
    assert full_name("base_model.model.lm_head.lora_A.weight") is None


def test_a_written_folder_reads_back_exactly(tmp_path) -> None:
    folder, adapters = _written(tmp_path)
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, "/models/base")
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    spec, read = read_peft_adapter(folder, tiny_arch("llama"))
    assert spec == SPEC and read.keys() == adapters.keys()
    assert all(torch.equal(read[k], v) for k, v in adapters.items())


def _edit_config(tmp_path, **fields) -> None:
    path = tmp_path / "adapter" / CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"use_dora": True}, r"adapter_config\.json: use_dora=True is not supported"),
        ({"use_rslora": True}, r"adapter_config\.json: use_rslora=True is not supported"),
        ({"bias": "all"}, r"adapter_config\.json: bias='all' is not supported"),
        ({"peft_type": "IA3"}, r"adapter_config\.json: peft_type='IA3', only LORA"),
        ({"r": 0}, r"adapter_config\.json: r=0 must be an integer > 0"),
        ({"lora_alpha": 0}, r"adapter_config\.json: lora_alpha=0\.0 must be > 0"),
        (
            {"target_modules": ["embed_tokens"]},
            r"adapter_config\.json: .*'embed_tokens' matches no linear layer",
        ),
        (
            {"target_modules": ["mlp.q_proj"]},
            r"adapter_config\.json: target_modules=\['mlp\.q_proj'\]: 'mlp\.q_proj' is not q_proj",
        ),
        # peft loads these onto W - scale * B0 A0 (the base rewritten); a merge onto W differs
        (
            {"init_lora_weights": "pissa"},
            r"adapter_config\.json: init_lora_weights='pissa' is not supported .*rewrites on load",
        ),
        ({"init_lora_weights": "pissa_niter_4"}, r"init_lora_weights='pissa_niter_4' is not supported"),
        ({"init_lora_weights": "olora"}, r"init_lora_weights='olora' is not supported"),
        ({"init_lora_weights": "loftq"}, r"init_lora_weights='loftq' is not supported"),
        ({"init_lora_weights": "corda"}, r"init_lora_weights='corda' is not supported"),
        ({"init_lora_weights": 1}, r"init_lora_weights=1 is not supported"),
    ],
    ids=[
        "dora",
        "rslora",
        "bias",
        "ia3",
        "rank0",
        "alpha0",
        "targets",
        "target-path",
        "pissa",
        "pissa-niter",
        "olora",
        "loftq",
        "corda",
        "init-1",
    ],
)
def test_what_our_adapters_cannot_carry_is_refused(tmp_path, fields, expected) -> None:
    folder, _ = _written(tmp_path)
    _edit_config(tmp_path, **fields)
    with pytest.raises(InputError, match=expected) as info:
        read_peft_adapter(folder, tiny_arch("llama"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "eva"])
def test_inits_that_leave_the_base_as_it_is_are_read(tmp_path, init) -> None:
    folder, _ = _written(tmp_path)
    _edit_config(tmp_path, init_lora_weights=init)
    assert read_peft_adapter(folder, tiny_arch("llama"))[0] == SPEC


def test_tensors_that_are_not_the_models_adapters_are_refused(tmp_path) -> None:
    folder, _ = _written(tmp_path)
    weights = tmp_path / "adapter" / WEIGHTS_FILE
    tensors = load_file(str(weights))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, name: torch.zeros(4, 3)}, str(weights))
    with pytest.raises(InputError, match=rf"{WEIGHTS_FILE}: {name} has shape \[4, 3\], the model needs"):
        read_peft_adapter(folder, tiny_arch("llama"))
    save_file({k: v for k, v in tensors.items() if k != name}, str(weights))
    with pytest.raises(InputError, match=rf"{WEIGHTS_FILE}: no tensor {name} \(1 adapters missing\)"):
        read_peft_adapter(folder, tiny_arch("llama"))
    extra = "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"  # the model has 2 layers
    save_file({**tensors, extra: torch.zeros(4, 3)}, str(weights))
    with pytest.raises(InputError, match=rf"{WEIGHTS_FILE}: tensor {extra} is no adapter of this model"):
        read_peft_adapter(folder, tiny_arch("llama"))


def test_a_resume_needs_the_adapters_the_checkpoint_was_saved_with(tmp_path) -> None:
    state = tmp_path / TRAINER_STATE_FILE
    state.write_text(json.dumps({"step": 2}))
    check_lora_matches(str(tmp_path), None)
    with pytest.raises(
        InputError, match=rf"{TRAINER_STATE_FILE}: saved without LoRA, this run has model\.lora_rank=4"
    ):
        check_lora_matches(str(tmp_path), SPEC)
    state.write_text(json.dumps({"step": 2, "lora": SPEC.to_json()}))
    check_lora_matches(str(tmp_path), SPEC)
    other = LoRASpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
    with pytest.raises(
        InputError, match=r"saved with model\.target_modules=\['q_proj', 'v_proj', 'down_proj'\]"
    ):
        check_lora_matches(str(tmp_path), other)
    with pytest.raises(InputError, match=r"saved with LoRA \(model\.lora_rank=4\), this run has none"):
        check_lora_matches(str(tmp_path), None)


# --- mcore-to-hf of LoRA checkpoints (convert/peft.py) ------------------------------------------------------
def _merge(tmp_path, adapter: str, base: str, *flags: str) -> int:
    out = str(tmp_path / "merged")
    return main(
        ["convert", "mcore-to-hf", "--ckpt", adapter, "--merge-lora", "--base", base, "--out", out, *flags]
    )


def test_merge_lora_refuses_a_nonfinite_adapter_naming_tensor_and_file(tmp_path, capsys) -> None:
    # --merge-lora wrote NaN weights with exit 0, where every other conversion refuses them.
    base = save_hf_model(str(tmp_path / "hf"), "llama")
    folder, adapters = _written(tmp_path)
    key = "decoder.layers.1.self_attention.linear_qkv.lora_B.v_proj.weight"
    adapters[key][0, 0] = float("nan")
    write_peft_adapter(folder, SPEC, adapters, None)
    assert _merge(tmp_path, folder, base) == 1
    err = capsys.readouterr().err
    assert f"{os.path.join(folder, WEIGHTS_FILE)}: tensor {peft_name(key)} holds 1 NaN/Inf value(s)" in err
    assert "--allow-nonfinite" in err and not (tmp_path / "merged").exists()
    assert _merge(tmp_path, folder, base, "--allow-nonfinite") == 0
    assert "warning:" in capsys.readouterr().err
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged["model.layers.1.self_attn.v_proj.weight"][0].isnan().all()


def test_merge_lora_of_a_bf16_base_to_fp32_is_not_rounded_to_bf16(tmp_path) -> None:
    # W + scale * B A was rounded to bf16 (the base's dtype) before the cast to the fp32 asked for.
    base = save_hf_model(str(tmp_path / "hf"), "llama", dtype=torch.bfloat16)
    folder, adapters = _written(tmp_path)
    assert _merge(tmp_path, folder, base, "--dtype", "fp32") == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    name, prefix = "model.layers.0.mlp.down_proj.weight", "decoder.layers.0.mlp.linear_fc2"
    weight = load_file(os.path.join(base, "model.safetensors"))[name]
    delta = adapters[f"{prefix}.lora_B.down_proj.weight"] @ adapters[f"{prefix}.lora_A.down_proj.weight"]
    expected = weight.float() + SPEC.scale * delta
    assert merged[name].dtype == torch.float32
    torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-5)
    assert merged["model.embed_tokens.weight"].dtype == torch.float32  # not adapted: cast alone


def _lora_run_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """A LoRA run checkpoint (fp32 adapters, the layout ``checkpoint_adapters`` reads); returns its adapters."""
    import torch.distributed.checkpoint as dcp

    from mcore_rl.convert.dist_layout import checkpoint_location
    from mcore_rl.engine.checkpoint import ModelCheckpointInfo

    arch, adapters = tiny_arch("llama"), _adapters(SPEC)
    stacked: dict[str, torch.Tensor] = {}
    for key, tensor in adapters.items():
        where = checkpoint_location(arch, key)
        stacked.setdefault(where.key, torch.zeros(*where.prefix_shape, *tensor.shape))
        stacked[where.key][where.prefix_offsets] = tensor
    os.mkdir(directory)
    dcp.save(stacked, checkpoint_id=directory, no_dist=True)
    ModelCheckpointInfo.for_arch(arch, torch.float32).write(directory)
    with open(os.path.join(directory, TRAINER_STATE_FILE), "w") as f:
        json.dump({"step": 1, "lora": SPEC.to_json()}, f)
    return adapters


def test_a_peft_folder_without_merge_lora_says_what_it_needs(tmp_path, capsys) -> None:
    # It ended with ".../trainer_state.json: no such file": a PEFT folder was read as a run checkpoint.
    folder, _ = _written(tmp_path)
    out = str(tmp_path / "out")
    assert main(["convert", "mcore-to-hf", "--ckpt", folder, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--ckpt {folder} is a PEFT adapter folder already" in err and "--merge-lora --base HF_DIR" in err
    assert "\n" not in err and TRAINER_STATE_FILE not in err and not os.path.exists(out)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_checkpoints_peft_export_takes_dtype(tmp_path) -> None:
    # --dtype was accepted and ignored: the adapters kept the checkpoint's fp32.
    ckpt, out = str(tmp_path / "global_step_1"), str(tmp_path / "peft")
    adapters = _lora_run_checkpoint(ckpt)
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out, "--dtype", "bf16"]) == 0
    written = load_file(os.path.join(out, WEIGHTS_FILE))
    assert written.keys() == {peft_name(k) for k in adapters}
    for key, tensor in adapters.items():
        assert written[peft_name(key)].dtype == torch.bfloat16
        assert torch.equal(written[peft_name(key)], tensor.to(torch.bfloat16))


def test_merging_into_another_base_than_the_adapters_name_says_so(tmp_path, capsys) -> None:
    # Adapters merged into a different model of the same shapes went through without a word.
    named = save_hf_model(str(tmp_path / "hf"), "llama")
    other = save_hf_model(str(tmp_path / "other"), "llama")
    folder, adapters = _written(tmp_path)
    write_peft_adapter(folder, SPEC, adapters, named)
    assert _merge(tmp_path, folder, named) == 0
    assert "note:" not in capsys.readouterr().err
    assert (
        main(
            [
                "convert",
                "mcore-to-hf",
                "--ckpt",
                folder,
                "--merge-lora",
                "--base",
                other,
                "--out",
                str(tmp_path / "m2"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"note: --base {other} is not the folder the adapters name as their base ({named})" in err
