"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, through conversion, at every layout.

- logits: HF -> megatron checkpoint (written with expert-parallel chunks) -> trainer at TP1, EP2, TP2 x EP2
  (with SP, which MoE under TP needs) and PP2 x EP2; fp32 logits within 1e-4 of transformers';
- the converter writes what megatron itself writes for an MoE model (per-layer keys, an expert axis);
- HF -> megatron (EP2 / TP2 chunks) -> HF is bit-exact, per-expert names included;
- a checkpoint whose expert count differs from its config is named before anything is written.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore
from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import save_model
from mcore_rl.engine.hf.mapping import ConvertError
from mcore_rl.engine.model import build_model_chunks
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.convert.hf_models import MOE_VARIANTS, hf_logits, save_hf_model
from tests.convert.test_dist_layout import _describe
from tests.convert.test_hf_parity import ATOL, _all_tensors, _convert_and_forward, _max_diffs, _tokens

EP2 = {"expert_model_parallel_size": 2}
LAYOUTS_WORLD2 = {"tp1": {}, "ep2": EP2}
LAYOUTS_WORLD4 = {
    "tp2-ep2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, **EP2},
    "pp2-ep2": {"pipeline_model_parallel_size": 2, **EP2},
}


def _parity(run_distributed, tmp_path, variant: str, layouts: dict, world_size: int) -> None:
    family, overrides = MOE_VARIANTS[variant]
    hf_dir = save_hf_model(str(tmp_path / "hf"), family, **overrides)
    tokens = _tokens()  # 16 tokens: past mixtral's sliding window of 8
    expected = hf_logits(hf_dir, tokens)
    results = run_distributed(
        _convert_and_forward, hf_dir, str(tmp_path / "ckpt"), layouts, tokens, 1, 1, 2, world_size=world_size
    )
    diffs = _max_diffs(results, expected)
    print(f"\n{variant}: max |logit diff| vs transformers {diffs}")
    assert set(diffs) == set(layouts)
    assert all(d <= ATOL for d in diffs.values()), diffs


# CI time: Qwen3-MoE in the default tier; Mixtral, the unnormalised top-k and the world-4 layouts in the sweep
# tier (the hybrid test runs TP2xEP2 in the default tier; the driver test EP2 through Ray)
@pytest.mark.parametrize(
    "variant",
    [v if v == "qwen3-moe" else pytest.param(v, marks=pytest.mark.sweep) for v in sorted(MOE_VARIANTS)],
)
def test_moe_logits_match_transformers_tp1_ep2(run_distributed, tmp_path, variant):
    _parity(run_distributed, tmp_path, variant, LAYOUTS_WORLD2, world_size=2)


@pytest.mark.sweep
@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_moe_logits_match_transformers_tp2xep2_pp2xep2(run_distributed, tmp_path, variant):
    _parity(run_distributed, tmp_path, variant, LAYOUTS_WORLD4, world_size=4)


def _megatron_and_converted(hf_dir: str, tmp: str, parallel: dict, options: dict) -> None:
    arch = ModelArch.from_hf_config(hf_dir)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        save_model(build_model_chunks(arch, ctx), ctx, os.path.join(tmp, "megatron"))
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, os.path.join(tmp, "converted"), **options))


@pytest.mark.parametrize(
    ("parallel", "options"),
    [
        (EP2, {"ep": 2}),
        pytest.param(
            {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 2},
            {"tp": 2},
            marks=pytest.mark.sweep,
        ),
    ],
    ids=["ep2", "tp2-etp2"],
)
def test_converted_moe_checkpoint_has_megatrons_layout(run_distributed, tmp_path, parallel, options):
    hf_dir = save_hf_model(str(tmp_path / "hf"), "qwen3_moe")  # MoE and dense layers mixed
    run_distributed(_megatron_and_converted, hf_dir, str(tmp_path), parallel, options)
    megatron, converted = _describe(str(tmp_path / "megatron")), _describe(str(tmp_path / "converted"))
    assert sorted(megatron) == sorted(converted)
    for key in megatron:
        assert megatron[key] == converted[key], key
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight" in megatron  # the expert axis


def _round_trip(hf_dir: str, ckpt: str, out: str, options: dict) -> None:
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, ckpt, **options))
    convert_mcore_to_hf(McoreToHfOptions(ckpt, out))


@pytest.mark.parametrize(
    ("variant", "options"),
    [  # bf16 round trips: a second each
        ("qwen3-moe", {}),
        ("qwen3-moe", {"ep": 2}),
        ("mixtral", {"tp": 2}),
        ("qwen3-moe-unnormed", {"tp": 2, "ep": 2, "etp": 1}),
    ],
    ids=["tp1", "ep2", "mixtral-tp2", "tp2-ep2-etp1"],
)
def test_moe_hf_mcore_hf_is_bit_exact(run_distributed, tmp_path, variant, options):
    family, overrides = MOE_VARIANTS[variant]
    hf_dir = save_hf_model(str(tmp_path / "hf"), family, dtype=torch.bfloat16, **overrides)
    out = tmp_path / "back"
    run_distributed(_round_trip, hf_dir, str(tmp_path / "ckpt"), str(out), options)
    before, after = _all_tensors(hf_dir), _all_tensors(str(out))
    assert sorted(before) == sorted(after)
    assert any(".experts.3." in name for name in before)  # every expert, by its HF name
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text()
    )


def test_checkpoint_with_other_expert_count_is_named(tmp_path):
    save_hf_model(str(tmp_path / "hf"), "qwen3_moe")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_local_experts"] = 8  # the weights hold 4 experts per layer
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=r"mlp\.gate\.weight has shape \[4, 64\].*num_experts=8"):
        convert_hf_to_mcore(HfToMcoreOptions(str(tmp_path / "hf"), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_megatron_checkpoint_with_other_expert_count_is_named(tmp_path):
    hf_dir = save_hf_model(str(tmp_path / "hf"), "qwen3_moe")
    ckpt = convert_hf_to_mcore(HfToMcoreOptions(hf_dir, str(tmp_path / "ckpt")))
    info = tmp_path / "ckpt" / "mcore_rl_model.json"
    saved = json.loads(info.read_text())
    saved["hf_config"]["num_local_experts"] = 8
    info.write_text(json.dumps(saved))
    with pytest.raises(
        ConvertError,
        match=r"ckpt: decoder\.layers\.0\.mlp\.router\.weight has shape \[4, 64\], the config implies \[8, 64\]",
    ):
        convert_mcore_to_hf(McoreToHfOptions(ckpt, str(tmp_path / "back")))
    assert not (tmp_path / "back").exists()
