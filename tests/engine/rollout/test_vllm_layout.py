"""vLLM's reshard target on CPU: vocab padded to 64, consecutive TP ranks, fused expert parameters (Qwen3-MoE,
Mixtral), exact shard checks, vLLM's sampling rules, the seed broadcast. The same names and shapes are checked
against vLLM's own model classes by tests_vllm/ (``make test-vllm``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.rollout import SamplingParams, SamplingParamsError, rollout_shards_from_full
from mcore_rl.engine.rollout.from_megatron import rollout_tensors
from mcore_rl.engine.rollout.layout import RolloutLayoutError
from mcore_rl.engine.rollout.vllm_engine import check_free_memory, set_launcher_env, shared_seed
from mcore_rl.engine.rollout.vllm_layout import (
    VLLMSlice,
    VLLMWeightError,
    build_vllm_plan,
    check_covered,
    check_shard_shapes,
    check_vllm_sampling,
    vllm_padded_vocab,
    vllm_param_name,
    vllm_param_shapes,
    vllm_target,
    vllm_vocab_divisible_by,
)
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.parallel.reshard import arch_param_specs, build_plan, padded_rows
from mcore_rl.parallel.reshard.executor import execute_plan, shard_shape
from mcore_rl.parallel.sharding import tp_shard
from tests.engine.rollout.common import random_full_state
from tests.models import tiny_arch


@pytest.mark.parametrize(("vocab", "tp", "rows"), [(151936, 2, 75968), (128256, 4, 32064), (250, 4, 64)])
def test_vocab_rows_are_vllms_not_megatrons(vocab: int, tp: int, rows: int) -> None:
    """The review's examples: megatron's 128 x tp padding gives 76032 / 32128 / 128 rows per rank."""
    arch = tiny_arch("llama", vocab_size=vocab, num_key_value_heads=4)
    shapes = vllm_param_shapes(arch, tp)
    assert shapes["model.embed_tokens.weight"] == (rows, 64)
    assert shapes["lm_head.weight"] == (rows, 64)
    plan = build_vllm_plan(arch, ParallelLayout(tp, tp=1), tp)
    assert shard_shape(plan.specs["output_layer.weight"], tp, plan.rollout_vocab_divisible_by) == (rows, 64)
    default = build_plan(
        arch_param_specs(arch), ParallelLayout(tp, tp=1), tp, num_layers=4, tied_embeddings=False
    )
    assert shard_shape(default.specs["output_layer.weight"], tp, default.rollout_vocab_divisible_by) != (
        rows,
        64,
    )


def test_tied_model_has_no_lm_head_and_every_name_has_vllms_prefix() -> None:
    shapes = vllm_param_shapes(tiny_arch("qwen2"), 2)
    assert "lm_head.weight" not in shapes
    assert all(name.startswith("model.") for name in shapes)
    assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == ((4 + 2 * 2) // 2 * 16,)
    assert vllm_param_name("lm_head.weight") == "lm_head.weight"


def test_tp_must_divide_vllms_padding() -> None:
    assert [vllm_vocab_divisible_by(tp) for tp in (1, 2, 4, 8)] == [64, 32, 16, 8]
    assert vllm_padded_vocab(250) == 256 and vllm_padded_vocab(256) == 256
    with pytest.raises(RolloutLayoutError, match="tensor_parallel_size=3"):
        vllm_vocab_divisible_by(3)


def test_vllm_plan_takes_consecutive_ranks_where_nesting_would_not() -> None:
    """train TP2, rollout TP4 on 8 ranks: nesting gives rank 1 coordinate 2; vLLM gives it 1 % 4."""
    arch = tiny_arch("llama", num_key_value_heads=4)
    plan = build_vllm_plan(arch, ParallelLayout(8, tp=2), 4)
    assert {r: c[0] for r, c in plan.rollout_coords.items()} == {r: r % 4 for r in range(8)}
    assert plan.rollout_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _whole(shapes: dict[str, tuple[int, ...]]) -> dict[VLLMSlice, tuple[int, ...]]:
    return {VLLMSlice(name): shape for name, shape in shapes.items()}


def test_shard_check_refuses_rank_name_and_shape_mismatches() -> None:
    params = vllm_param_shapes(tiny_arch("llama", num_key_value_heads=4), 4)
    check_shard_shapes(params, _whole(params), tp_rank=1, expected=1)  # an exact load passes
    with pytest.raises(VLLMWeightError, match=r"tensor-parallel rank is 1 but .* coordinate 2"):
        check_shard_shapes(params, _whole(params), tp_rank=1, expected=2)
    with pytest.raises(VLLMWeightError, match="no parameters named"):
        check_shard_shapes(
            params, _whole({"model.layers.9.mlp.down_proj.weight": (64, 24)}), tp_rank=0, expected=0
        )
    megatron_rows = _whole({"lm_head.weight": (128, 64)})  # 250 padded to 128 x 4 instead of 64
    with pytest.raises(
        VLLMWeightError, match=r"lm_head.weight: shard shape \(128, 64\) != vLLM's \(64, 64\)"
    ):
        check_shard_shapes(params, megatron_rows, tp_rank=0, expected=0)


MOE_ARCHS = {"qwen3_moe": tiny_arch("qwen3_moe"), "mixtral": tiny_arch("mixtral")}


def test_experts_are_slices_of_vllms_fused_parameters() -> None:
    """Qwen3-MoE: 4 experts of 32 at TP 2 under ``mlp`` (layer 1 dense: mlp_only_layers); Mixtral: 4 experts of
    48 under ``block_sparse_moe`` on every layer."""
    qwen = vllm_param_shapes(MOE_ARCHS["qwen3_moe"], 2)
    fused = "model.layers.0.mlp.experts.routed_experts."
    assert (qwen[fused + "w13_weight"], qwen[fused + "w2_weight"]) == ((4, 32, 64), (4, 64, 16))
    assert qwen["model.layers.0.mlp.gate.weight"] == (4, 64)  # the router, replicated
    assert qwen["model.layers.1.mlp.gate_up_proj.weight"] == (96, 64)  # the dense layer's MLP
    assert not any(".experts." in n for n in qwen if n.startswith("model.layers.1."))
    assert vllm_target("layers.2.mlp.experts.3.gate_up_proj.weight", MOE_ARCHS["qwen3_moe"]) == VLLMSlice(
        "model.layers.2.mlp.experts.routed_experts.w13_weight", 3
    )
    mixtral = MOE_ARCHS["mixtral"]
    shapes = vllm_param_shapes(mixtral, 2)
    assert not any(".mlp." in n for n in shapes)
    block = "model.layers.3.block_sparse_moe."
    assert shapes[block + "experts.routed_experts.w2_weight"] == (4, 64, 24)
    assert vllm_target("layers.3.mlp.gate.weight", mixtral) == VLLMSlice(block + "gate.weight")
    assert vllm_target("layers.3.mlp.experts.0.down_proj.weight", mixtral) == VLLMSlice(
        block + "experts.routed_experts.w2_weight", 0
    )
    assert vllm_target("layers.3.self_attn.o_proj.weight", mixtral) == VLLMSlice(
        "model.layers.3.self_attn.o_proj.weight"
    )


def test_shard_check_takes_fused_experts_whole_only() -> None:
    arch = MOE_ARCHS["qwen3_moe"]
    params = vllm_param_shapes(arch, 2)
    shards = {vllm_target(n, arch): s for n, s in rollout_shards_shapes(arch, 2).items()}
    check_shard_shapes(params, shards, tp_rank=0, expected=0)
    w13 = "model.layers.2.mlp.experts.routed_experts.w13_weight"
    del shards[VLLMSlice(w13, 1)]
    with pytest.raises(VLLMWeightError, match=r"w13_weight: this load lacks experts \[1\]"):
        check_shard_shapes(params, shards, tp_rank=0, expected=0)
    shards[VLLMSlice(w13, 1)] = (64, 64)  # TP1's gate/up rows at TP 2
    with pytest.raises(
        VLLMWeightError, match=r"w13_weight \(expert 1\): shard shape \(64, 64\) != vLLM's \(32, 64\)"
    ):
        check_shard_shapes(params, shards, tp_rank=0, expected=0)
    shards[VLLMSlice(w13, 1)] = (32, 64)
    shards[VLLMSlice(w13, 4)] = (32, 64)
    with pytest.raises(VLLMWeightError, match="expert 4 of 4"):
        check_shard_shapes(params, shards, tp_rank=0, expected=0)
    del shards[VLLMSlice(w13, 4)]
    w2 = {
        target: s
        for target, s in shards.items()
        if target.name.endswith("layers.2.mlp.experts.routed_experts.w2_weight")
    }
    with pytest.raises(VLLMWeightError, match=r"w13_weight without .*w2_weight: vLLM's CPU kernel repacks"):
        check_shard_shapes(params, {t: s for t, s in shards.items() if t not in w2}, tp_rank=0, expected=0)


def test_qwen3_moe_tp_above_the_expert_count_is_refused() -> None:
    arch = tiny_arch("qwen3_moe", num_experts=2, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(RolloutLayoutError, match="tensor_model_parallel_size=4 is larger than num_experts=2"):
        vllm_param_shapes(arch, 4)


def test_moe_models_vllm_would_refuse_are_refused_before_any_process_starts() -> None:
    """Found from the config alone (no vLLM import): the CPU fused-MoE kernel's hidden-size tiles, and Qwen3-MoE's
    rollout TP above its expert count; a dense model and a GPU are not held to the CPU kernel's rule."""
    from mcore_rl.engine.rollout.vllm_compat import preflight_problems

    odd = tiny_arch("qwen3_moe", hidden_size=80, head_dim=32)
    assert preflight_problems(odd, 1, on_gpu=False, installed=True) == [
        "rollout.name=vllm: hidden_size=80: vLLM's CPU fused-MoE kernel needs a multiple of 32; use "
        "rollout.name=local for this model"
    ]
    assert preflight_problems(odd, 1, on_gpu=True, installed=True) == []
    assert (
        preflight_problems(
            tiny_arch("llama", hidden_size=80, num_attention_heads=1, num_key_value_heads=1),
            1,
            on_gpu=False,
            installed=True,
        )
        == []
    )
    few = tiny_arch("qwen3_moe", hidden_size=128, head_dim=32, num_experts=2)
    assert preflight_problems(few, 4, on_gpu=True, installed=True) == [
        "rollout.tensor_model_parallel_size=4 is larger than num_experts=2: vLLM's Qwen3-MoE refuses it "
        "(rollout.name=vllm)"
    ]
    assert (
        preflight_problems(
            tiny_arch("mixtral", hidden_size=128, num_local_experts=2), 4, on_gpu=True, installed=True
        )
        == []
    )


def rollout_shards_shapes(arch, tp: int) -> dict[str, tuple[int, ...]]:
    from mcore_rl.engine.rollout.layout import rollout_param_shapes

    rows = vllm_padded_vocab(arch.vocab_size) // tp
    shapes = rollout_param_shapes(arch, tp)
    return {
        n: (rows, *s[1:]) if n in ("embed_tokens.weight", "lm_head.weight") else s for n, s in shapes.items()
    }


def test_generation_needs_every_parameter_loaded() -> None:
    check_covered(set())
    with pytest.raises(VLLMWeightError, match="a, b, c, d, e and 1 more"):
        check_covered({"f", "e", "d", "c", "b", "a"})


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(temperature=2.5), "at most 2.0"),
        (SamplingParams(temperature=0.005), "samples at 0.01"),
        (SamplingParams(temperature=0.0, n=2), "n=2 with temperature=0"),
    ],
)
def test_sampling_that_vllm_refuses_or_changes_is_refused(params: SamplingParams, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        check_vllm_sampling(params)


def test_sampling_that_vllm_takes_as_is_passes() -> None:
    for params in (
        SamplingParams(temperature=2.0, n=4),
        SamplingParams(temperature=0.01),
        SamplingParams(0.0),
    ):
        check_vllm_sampling(params)


def test_free_memory_check_names_the_field() -> None:
    check_free_memory(60 << 30, 100 << 30, 0.5)
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.5 .* lower gpu_memory_utilization below 0.30"
    ):
        check_free_memory(30 << 30, 100 << 30, 0.5)


def test_launcher_env_is_set_only_where_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "5")
    set_launcher_env(3, 1)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("5", "1")


def _seeds() -> list[int]:
    torch.manual_seed(dist.get_rank())  # the ranks' global RNGs disagree, as after a per-rank data shuffle
    group = dist.group.WORLD
    return [shared_seed(None, group), shared_seed(None, group), shared_seed(17, group)]


def _vllm_reshard(train: ParallelLayout, tp_g: int, family: str) -> list[str]:
    """Every rank's resharded, renamed tensors vs vLLM's slicing of the full state; returns the mismatches."""
    rank = dist.get_rank()
    arch = tiny_arch(family, num_key_value_heads=4)
    full = random_full_state(arch)
    plan = build_vllm_plan(arch, train, tp_g)
    local = {}
    for s in plan.specs.values():
        if s.expert is None:
            size, coord = train.tp, train.coords(rank).tp
        elif s.expert in train.local_experts(rank, arch.moe.num_experts):  # the EP block holding it
            size, coord = train.expert_tp, train.expert_coords(rank).etp
        else:
            continue
        local[s.name] = tp_shard(full[s.name], s.kind, coord, size, padded_rows(s, size))
    out, _ = execute_plan(plan, local)
    got = {vllm_target(n, arch): t for n, t in rollout_tensors(out, arch)}
    coord = rank % tp_g  # vLLM's TP rank
    check_shard_shapes(
        vllm_param_shapes(arch, tp_g),
        {n: tuple(t.shape) for n, t in got.items()},
        tp_rank=coord,
        expected=plan.rollout_coords[rank][0],
    )
    expected = {vllm_target(n, arch): t for n, t in rollout_shards_from_full(full, arch, tp_g, coord).items()}
    padded = vllm_padded_vocab(arch.vocab_size)
    for name, key in (
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ):
        if key in full:  # vLLM's rows: vocab padded to 64 at the end, equal blocks
            rows = torch.cat([full[key], full[key].new_zeros(padded - arch.vocab_size, arch.hidden_size)])
            expected[VLLMSlice(name)] = rows.chunk(tp_g)[coord]
    assert set(got) == set(expected)
    assert {target.name for target in got} == set(vllm_param_shapes(arch, tp_g))
    return [str(target) for target in got if not torch.equal(got[target], expected[target])]


def test_unseeded_requests_share_the_first_ranks_seed(run_distributed) -> None:
    first, second = run_distributed(_seeds)
    assert first == second and first[2] == 17 and first[0] != first[1]


@pytest.mark.parametrize(
    ("train", "tp_g", "family"),
    [
        (ParallelLayout(4, tp=2), 4, "llama"),
        (ParallelLayout(4), 2, "qwen2"),
        (ParallelLayout(4, ep=2), 2, "mixtral"),
        (ParallelLayout(4, tp=2, sp=True, ep=2), 4, "qwen3_moe"),
    ],
    ids=["tp2-to-tp4", "dp4-to-tp2-tied", "ep2-to-tp2-mixtral", "tp2-ep2-to-tp4-qwen3-moe"],
)
def test_executed_vllm_plan_gives_vllms_shards(
    run_distributed, train: ParallelLayout, tp_g: int, family: str
) -> None:
    """The R3 case: train TP2 -> rollout TP4 on 4 ranks, vocab 250 (vLLM: 64 rows a rank; megatron: 128); MoE:
    each EP block sends its own experts, every rollout rank gets its slice of every expert of the fused
    parameters."""
    assert run_distributed(_vllm_reshard, train, tp_g, family, world_size=4) == [[]] * 4
