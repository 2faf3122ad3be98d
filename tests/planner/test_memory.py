"""Planner memory terms against hand-computed cases, validation errors, and the proposed layout."""

from __future__ import annotations

import pytest

from mcore_rl.engine.arch import ModelArch
from mcore_rl.planner import GPU_MEMORY_BYTES, PlanError, PlanInput, plan_memory, smallest_fitting_layout
from mcore_rl.planner.report import format_plan
from tests.models import tiny_arch
from tests.planner.hf_configs import LLAMA31_8B, LLAMA31_70B

MIB, GIB = 1 << 20, 1 << 30


def _llama8b(**changes) -> PlanInput:
    fields = dict(
        arch=ModelArch.from_hf_config(LLAMA31_8B),
        gpu="A100-80",
        world_size=8,
        tp=2,
        sp=True,
        seq_length=4096,
        micro_batch_size=1,
        global_batch_size=256,
        recompute="selective",
        rollout_tp=2,
    )
    fields.update(changes)
    return PlanInput(**fields)


def test_llama31_8b_tp2_sp_selective_on_8xa100_80():
    result = plan_memory(_llama8b())
    params = 4_015_263_744  # one TP2 rank, see test_params
    train = result.train.terms
    # bf16 with the distributed optimizer over dp = 8 / 2 = 4: 2 + 4 + 12/4 bytes per parameter.
    assert train["weights"] == 2 * params == 8_030_527_488
    assert train["gradients"] == 4 * params
    assert train["optimizer"] == 3 * params
    # Per layer, bf16 (2 B), s*b = 4096 tokens, h = 4096, q = 4096, kv = 1024, f = 14336, t = 2, SP:
    #   2 * (4*4096*4096/2 + 4096*(2*4096 + 2*1024 + 3*14336)/2) = 2 * (33,554,432 + 109,051,904)
    #   = 285,212,672; 32 layers, one micro-batch in flight, + 16 B of token/position ids per token.
    assert train["activations"] == 32 * 285_212_672 + 16 * 4096
    # LM head (the fused log-prob op's backward), n = 4096 tokens, h = 4096, 4096-column vocab chunks, bf16:
    # saved hidden 2 n h + fp32 hidden gradient 4 n h + logits and gradient blocks 2 x 2 n c + the weight's
    # gradient 2 x 64,128 rows x h + the [max(n, c), h] bf16 temporary 2 n h.
    assert train["LM head"] == 4096 * 4096 * (2 + 4 + 4 + 2) + 2 * 64_128 * 4096
    # The sleeping rollout holds no weights on the GPU (vLLM sleeps at level 2, the embedded engine's level 1
    # moves them to host memory); awake, rollout TP2 holds the same shards as training TP2.
    assert not any("rollout" in name for name in train)
    assert result.rollout.terms["rollout weights"] == 2 * params
    assert result.train.largest == "gradients"

    rollout = result.rollout.terms
    assert set(rollout) == {"weights", "rollout weights", "rollout activations", "kv cache"}  # all offloaded
    # Rollout activations: 2 B x 8192 tokens x (2*4096 + 3*14336/2) + 4 B x 256 seqs x 128,256 vocab.
    assert rollout["rollout activations"] == 2 * 8192 * (8192 + 21504) + 4 * 256 * 128_256 == 617_873_408
    pool = 40960 * MIB  # half of the A100-80's 81,920 MiB
    assert rollout["kv cache"] == pool - 2 * params - 617_873_408
    # K and V x 32 layers x 8/2 kv heads x 128 x 2 B = 65,536 B per token.
    assert result.kv_bytes_per_token == 65_536
    assert result.kv_cache_tokens == rollout["kv cache"] // 65_536 == 523_395

    switch = result.switch.terms
    assert switch == {"weights": 2 * params, "rollout weights": 2 * params, "reshard buffers": 512 * MIB}
    assert result.fits and result.peak_bytes == result.rollout.total_bytes  # the KV cache pool is the peak
    assert result.train.capacity_bytes == 81920 * MIB - 3 * GIB


def test_llama31_70b_tp8_pp4_vpp5_on_4x8_a100_80():
    result = plan_memory(
        PlanInput(
            arch=ModelArch.from_hf_config(LLAMA31_70B),
            gpu="A100-80",
            world_size=32,
            tp=8,
            pp=4,
            vpp=5,
            sp=True,
            seq_length=4096,
            global_batch_size=256,
            recompute="selective",
            rollout_tp=8,
        )
    )
    params = 2_271_551_488  # the last stage's rank, see test_params
    train = result.train.terms
    # dp = 32 / 32 = 1: the distributed optimizer cannot shard: 2 + 4 + 12 = 18 B per parameter.
    assert train["weights"] + train["gradients"] + train["optimizer"] == 18 * params
    # Per layer: 2 * (4*4096*8192/8 + 4096*(2*8192 + 2*1024 + 3*28672)/8) = 2 * (16,777,216 + 53,477,376)
    #   = 140,509,184; 20 layers per stage; interleaved: 4 * (1 + 3/(4*5)) = 4.6 micro-batches in flight.
    assert train["activations"] == pytest.approx((20 * 140_509_184 + 16 * 4096) * 4.6, abs=1)
    # LM head: n = 4096, h = 8192, chunks of c = 4096 of the 16,128 rows: 2 n h + 4 n h + 2 x 2 n c + 2 x
    # 16,128 h + 2 h max(n, c).
    assert train["LM head"] == 4096 * 8192 * (2 + 4 + 2) + 4 * 4096 * 4096 + 2 * 16_128 * 8192
    # K and V x 80 layers x 8/8 kv heads x 128 x 2 B.
    assert result.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert result.train.largest == "optimizer"


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    base = _llama8b(recompute="selective")
    full = plan_memory(_llama8b(recompute="full")).train.terms["activations"]
    # Each of 32 layers keeps its input, 2 B x 4096 x 4096 / 2 (SP); + the recomputed layer's selective set.
    assert full == 32 * 2 * 4096 * 4096 // 2 + 16 * 4096 + 285_212_672
    assert full < plan_memory(base).train.terms["activations"]


def test_unfused_attention_stores_the_scores_unless_recomputed():
    # 2 B x heads 32 x s^2 (4096^2) x b / t=2 more per layer without flash attention or selective recompute.
    none = plan_memory(_llama8b(recompute="none", flash_attention=False)).train.terms["activations"]
    selective = plan_memory(_llama8b(recompute="selective", flash_attention=False)).train.terms["activations"]
    assert none - selective == 32 * 2 * 32 * 4096 * 4096 // 2


def test_one_f_one_b_holds_min_pp_and_microbatches():
    # PP2 without interleaving: 16 layers per stage, 2 micro-batches in flight on the first stage.
    result = plan_memory(_llama8b(tp=2, pp=2, global_batch_size=256))
    assert result.train.terms["activations"] == 2 * (16 * 285_212_672 + 16 * 4096)
    # Only one micro-batch per step: only one in flight.
    single = plan_memory(_llama8b(tp=2, pp=2, world_size=4, global_batch_size=1))
    assert single.train.terms["activations"] == 16 * 285_212_672 + 16 * 4096


def test_colocated_critic_and_reference_add_their_state():
    plain = plan_memory(_llama8b())
    both = plan_memory(_llama8b(critic=True, reference=True))
    critic_params = 4_015_263_744 - 262_668_288 + 4096  # output layer -> value head [1, h]
    assert both.train.terms["critic weights"] == 2 * critic_params
    assert both.train.terms["critic optimizer"] == 3 * critic_params
    assert both.train.terms["reference weights"] == plain.train.terms["weights"]
    # During rollout the critic and reference weights stay, and so does the critic's state: the hybrid engine
    # offloads only the actor's gradients and optimizer.
    assert {"critic weights", "reference weights", "critic gradients", "critic optimizer"} <= set(
        both.rollout.terms
    )
    assert "optimizer" not in both.rollout.terms


def test_optimizer_kept_on_gpu_when_not_offloaded():
    result = plan_memory(_llama8b(offload_optimizer=False))
    assert result.rollout.terms["optimizer"] == result.train.terms["optimizer"]
    assert "gradients" not in result.rollout.terms


def test_too_big_layout_reports_the_largest_term_and_proposes_a_fitting_one():
    asked = _llama8b(gpu="A100-40", tp=1, sp=False, micro_batch_size=4, recompute="none", rollout_tp=1)
    result = plan_memory(asked)
    assert not result.fits
    assert result.train.largest == "activations"
    proposal = smallest_fitting_layout(asked)
    assert proposal is not None and proposal.fits
    # Half a node suffices once the model is split: TP4 with full recompute, 0.8 GiB to spare (the LM head's
    # 1.0 GiB included; it never holds the 16k x 32k logits of a micro-batch).
    assert (proposal.plan.world_size, proposal.plan.tp, proposal.plan.recompute) == (4, 4, "full")
    # Nothing on 8 GPUs with a smaller tp*pp fits (the search's order, checked directly).
    for tp in (1, 2):
        for recompute in ("none", "selective", "full"):
            for rollout_tp in (1, 2, 4, 8):
                smaller = asked.with_layout(tp=tp, sp=tp > 1, recompute=recompute, rollout_tp=rollout_tp)
                assert not plan_memory(smaller).fits
    assert proposal.plan.tp * proposal.plan.pp >= 4
    text = format_plan(result, proposal, searched=True)
    assert (
        "DOES NOT FIT" in text and "largest term: activations" in text and "smallest layout that fits" in text
    )


def test_every_known_gpu_is_sized():
    assert GPU_MEMORY_BYTES["H200-141"] > GPU_MEMORY_BYTES["H100-80"] > GPU_MEMORY_BYTES["A100-40"]
    assert plan_memory(_llama8b(gpu="H200-141")).fits


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"tp": 3, "world_size": 6},
            r"num_attention_heads=32 is not divisible by tensor_model_parallel_size=3",
        ),
        (
            {"tp": 1, "sp": False, "pp": 3, "world_size": 3},
            r"num_layers=32 is not divisible by pipeline_model_parallel_size=3",
        ),
        (
            {"tp": 1, "sp": False, "pp": 2, "vpp": 3},
            r"num_layers=32 is not divisible by .*virtual_pipeline_model_parallel_size=6",
        ),
        ({"tp": 4, "gpus_per_node": 6}, r"tensor_model_parallel_size=4 must divide gpus_per_node=6"),
        ({"world_size": 7}, r"world_size=7 is not divisible by tp\*pp=2\*1"),
        ({"global_batch_size": 250}, r"global_batch_size=250 is not divisible by micro_batch_size\*dp=1\*4"),
        (
            {"pp": 2, "vpp": 2, "global_batch_size": 6},
            r"micro-batches per step=3 .* multiple of pipeline_model_par",
        ),
        ({"seq_length": 4095}, r"sequence length 4095 is not divisible by tensor_model_parallel_size=2"),
        ({"rollout_tp": 8, "gpus_per_node": 4}, r"rollout_tp=8 must divide gpus_per_node=4"),
        ({"gpu": "V100"}, r"gpu='V100' is not known"),
        ({"recompute": "some"}, r"recompute='some' must be one of"),
        ({"rollout_memory_fraction": 1.5}, r"rollout_memory_fraction must be in \(0, 1\)"),
    ],
)
def test_invalid_inputs_name_the_field(changes, message):
    with pytest.raises(PlanError, match=message):
        plan_memory(_llama8b(**changes))


def test_kv_heads_not_divisible_by_rollout_tp_is_refused():
    plan = PlanInput(arch=tiny_arch("llama"), gpu="A100-80", world_size=4, seq_length=32, rollout_tp=4)
    with pytest.raises(PlanError, match=r"num_key_value_heads=2 is not divisible by the rollout"):
        plan_memory(plan)
