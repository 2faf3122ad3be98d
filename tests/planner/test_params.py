"""Parameter counts: the whole model against the published sizes and transformers, one rank against
hand-computed shard sizes."""

from __future__ import annotations

import pytest

from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.planner import layer_params, model_params, rank_params, stage_params
from tests.models import tiny_hf_config
from tests.planner.hf_configs import LLAMA31_8B, LLAMA31_70B, QWEN3_0_6B, QWEN3_8B, QWEN25_7B


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LLAMA31_8B, 8_030_261_248),
        (LLAMA31_70B, 70_553_706_496),
        (QWEN25_7B, 7_615_616_512),
        # Qwen3's model cards: 0.6B (0.44B without the embedding) and 8.2B (6.95B)
        (QWEN3_0_6B, 596_049_920),
        (QWEN3_8B, 8_190_735_360),
    ],
    ids=["llama3.1-8b", "llama3.1-70b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b"],
)
def test_model_params_match_the_published_counts(config, expected):
    # The counts the HF model cards / safetensors indexes give for these checkpoints.
    assert model_params(ModelArch.from_hf_config(config)) == expected


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_model_params_match_transformers_on_the_tiny_models(family):
    import transformers

    cfg = tiny_hf_config(family)
    architecture = cfg.pop("architectures")[0]
    model = getattr(transformers, architecture)(
        transformers.AutoConfig.for_model(**cfg, architectures=[architecture])
    )
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
    assert model_params(ModelArch.from_hf_config(tiny_hf_config(family))) == expected


def test_llama31_8b_tp2_rank_holds_half_the_matrices():
    arch = ModelArch.from_hf_config(LLAMA31_8B)
    # One layer, TP2: q = 32*128 = 4096, kv = 8*128 = 1024, h = 4096, f = 14336.
    #   qkv (4096 + 2*1024)*4096 = 25,165,824; proj 4096*4096 = 16,777,216; fc1+fc2 3*14336*4096 = 176,160,768
    #   -> 218,103,808 / 2 = 109,051,904, + two replicated norms 2*4096 = 109,060,096
    assert layer_params(arch, tp=2) == 109_060_096
    # Vocab 128,256 is already a multiple of 128*2: 64,128 rows per rank, embedding and output layer each
    # 64,128*4096 = 262,668,288. Rank: 32 layers + embedding + output + final norm.
    expected = 32 * 109_060_096 + 2 * 262_668_288 + 4096
    assert expected == 4_015_263_744
    assert rank_params(arch, ParallelLayout(8, tp=2)) == (0, expected)


def test_llama31_70b_tp8_pp4_most_loaded_stage_is_the_last():
    arch = ModelArch.from_hf_config(LLAMA31_70B)
    layout = ParallelLayout(32, tp=8, pp=4, vpp=5, sp=True)
    # One layer, TP8: qkv (8192 + 2*1024)*8192 = 83,886,080; proj 8192^2 = 67,108,864;
    # MLP 3*28672*8192 = 704,643,072 -> 855,638,016 / 8 = 106,954,752, + norms 2*8192 = 106,971,136.
    # 80 / 4 = 20 layers per stage (5 virtual chunks of 4) = 2,139,422,720.
    # Vocab padded to a multiple of 128*8 = 1024: 129,024, so 16,128 rows per rank: 132,120,576 params.
    layers = 20 * 106_971_136
    assert stage_params(arch, layout, 0) == layers + 132_120_576  # embedding
    assert stage_params(arch, layout, 1) == layers
    assert stage_params(arch, layout, 3) == layers + 8192 + 132_120_576  # final norm + output layer
    assert rank_params(arch, layout) == (3, 2_271_551_488)


def test_tied_embeddings_count_once_on_one_stage_and_twice_across_stages():
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen2"))  # tied, 250-token vocab padded to 256
    one_stage = stage_params(arch, ParallelLayout(1), 0)
    two_stage = stage_params(arch, ParallelLayout(2, pp=2), 0) + stage_params(
        arch, ParallelLayout(2, pp=2), 1
    )
    assert two_stage - one_stage == 256 * 64  # the last stage's synchronised copy of the embedding
    value_head = stage_params(arch, ParallelLayout(1), 0, value_head=True)
    assert value_head - one_stage == 64  # the value head [1, h]; the embedding stays
