"""The planner under context parallelism: each rank's activations and logits count its share of the tokens,
the all-gather attention keeps every token's K and V, the optimizer shards over DP x CP, and the recipe for
16k-token responses fits its GPUs with the figures in its header."""

from __future__ import annotations

import pytest

from mcore_rl.config import load_config
from mcore_rl.engine.arch import ModelArch
from mcore_rl.planner import PlanError, PlanInput, plan_memory
from mcore_rl.planner.activations import activation_terms, layer_activation_bytes, lm_head_bytes
from mcore_rl.planner.from_config import plan_input_from_config
from tests.models import tiny_arch
from tests.planner.hf_configs import LLAMA31_8B, QWEN25_7B

GIB = 1 << 30


def _llama8b(**changes) -> PlanInput:
    fields = dict(
        arch=ModelArch.from_hf_config(LLAMA31_8B),
        gpu="H100-80",
        world_size=8,
        tp=2,
        sp=True,
        seq_length=8192,
        global_batch_size=64,
        rollout_tp=2,
    )
    fields.update(changes)
    return PlanInput(**fields)


def test_cp2_holds_what_cp1_holds_for_half_the_sequence():
    # TE's ring: every per-token term counts s / cp tokens, so CP2 at 8k is CP1 at 4k, byte for byte
    cp2, cp1_half = _llama8b(cp=2), _llama8b(seq_length=4096)
    assert activation_terms(cp2) == activation_terms(cp1_half)
    assert lm_head_bytes(cp2) == lm_head_bytes(cp1_half) == 4096 * 4096 * 12 + 2 * 64_128 * 4096
    assert activation_terms(cp2)["activations"] * 2 == pytest.approx(
        activation_terms(_llama8b())["activations"]
    )


def test_all_gather_attention_keeps_every_tokens_keys_and_values():
    arch = tiny_arch("llama")  # hidden 64, 4 heads x 16, 2 KV groups (kv = 32), MLP 96
    plan = PlanInput(
        arch=arch, gpu="H100-80", world_size=2, cp=2, seq_length=32, global_batch_size=2, bf16=False
    )
    p2p = layer_activation_bytes(plan)
    # 16 tokens on this rank: 4 x 16 x 64 (hidden width) + 16 x (2 x 64 + 2 x 32 + 3 x 96) (q, k, v, out, MLP)
    assert p2p == 4 * (4 * 16 * 64 + 16 * (2 * 64 + 2 * 32 + 3 * 96))
    gathered = layer_activation_bytes(plan.with_layout(cp_comm="all_gather"))
    assert gathered - p2p == 4 * 2 * 16 * 32  # the other rank's 16 tokens of K and V, fp32
    # an unfused attention's scores: chunks of 8 queries against 8 (r + 1) and 8 (4 - r) keys, 4 heads
    unfused = layer_activation_bytes(plan.with_layout(flash_attention=False))
    assert unfused - p2p == 4 * 4 * (8 * 8 * 5)


def test_optimizer_shards_over_data_and_context_parallel_ranks():
    # 8 GPUs, TP2: CP2 x DP2 holds the same optimizer shard as DP4 (the CP ranks hold the same weights)
    cp2, dp4 = plan_memory(_llama8b(cp=2)), plan_memory(_llama8b())
    assert cp2.plan.dp == 2 and cp2.train.terms["optimizer"] == dp4.train.terms["optimizer"]
    assert cp2.train.terms["activations"] < dp4.train.terms["activations"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cp": 3}, "context_parallel_size=3 does not divide world_size / \\(tp\\*pp\\)"),
        (
            {"cp": 2, "seq_length": 8190},
            "sequence length 8190 is not divisible by 2 x context_parallel_size=2",
        ),
        ({"cp": 2, "cp_comm": "ring"}, "cp_comm='ring' must be 'p2p' or 'all_gather'"),
    ],
)
def test_bad_context_parallel_inputs_name_the_field(changes, message):
    with pytest.raises(PlanError, match=message):
        plan_memory(_llama8b(**changes))


def test_long_response_recipe_fits_with_the_numbers_in_its_header():
    cfg = load_config("recipes/qwen2_5_7b_long_cp_h100.yaml", ["model.path=/nonexistent"])
    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(QWEN25_7B), gpu="H100-80")
    assert (plan.world_size, plan.tp, plan.cp, plan.pp, plan.dp, plan.rollout_tp) == (8, 2, 2, 1, 2, 2)
    assert plan.seq_length == 1024 + 16384 and plan.sp and plan.reference
    result = plan_memory(plan)
    assert result.fits, result.problems
    train = result.train.terms
    assert round(result.peak_bytes / GIB, 1) == 57.9
    assert (round(train["activations"] / GIB, 1), round(train["LM head"] / GIB, 1)) == (18.0, 0.9)
    assert round(result.kv_cache_tokens, -5) == 1_200_000 and result.kv_bytes_per_token == 28_672
    # the alternatives its header names
    figures = {
        (tp, cp, seq): round(plan_memory(plan.with_layout(tp=tp, cp=cp, seq_length=seq)).peak_bytes / GIB, 1)
        for tp, cp, seq in [(2, 1, 17408), (4, 1, 17408), (2, 4, 33792), (2, 2, 33792)]
    }
    assert figures == {(2, 1, 17408): 76.3, (4, 1, 17408): 46.9, (2, 4, 33792): 57.4, (2, 2, 33792): 75.2}
    # without CP the train phase fits on paper, with no margin worth the name
    cp1 = plan_memory(plan.with_layout(cp=1))
    assert round((cp1.train.capacity_bytes - cp1.peak_bytes) / GIB, 1) == 0.4


def test_config_lengths_are_padded_to_the_sequence_multiple():
    # 1000 + 1001 tokens at TP2 x CP2 with SP: the workers pad rows to a multiple of 2 x 2 x 2 = 8
    cfg = load_config(
        "recipes/qwen2_5_7b_long_cp_h100.yaml",
        ["model.path=/nonexistent", "data.max_prompt_length=1000", "data.max_response_length=1001"],
    )
    plan = plan_input_from_config(cfg, arch=ModelArch.from_hf_config(QWEN25_7B), gpu="H100-80")
    assert plan.seq_length == 2008
