"""vLLM's reshard target on CPU: vocab padded to 64, consecutive TP ranks, exact shard checks, vLLM's sampling
rules, the seed broadcast. The same names and shapes are checked against vLLM's own model classes by
tests_vllm/ (``make test-vllm``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.rollout import SamplingParams, SamplingParamsError, rollout_shards_from_full
from mcore_rl.engine.rollout.from_megatron import rollout_tensors
from mcore_rl.engine.rollout.layout import RolloutLayoutError
from mcore_rl.engine.rollout.vllm_engine import check_free_memory, set_launcher_env, shared_seed
from mcore_rl.engine.rollout.vllm_layout import (
    VLLMWeightError,
    build_vllm_plan,
    check_covered,
    check_shard_shapes,
    check_vllm_sampling,
    vllm_padded_vocab,
    vllm_param_name,
    vllm_param_shapes,
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


def test_shard_check_refuses_rank_name_and_shape_mismatches() -> None:
    params = vllm_param_shapes(tiny_arch("llama", num_key_value_heads=4), 4)
    check_shard_shapes(params, params, tp_rank=1, expected=1)  # an exact load passes
    with pytest.raises(VLLMWeightError, match=r"tensor-parallel rank is 1 but .* coordinate 2"):
        check_shard_shapes(params, params, tp_rank=1, expected=2)
    with pytest.raises(VLLMWeightError, match="no parameters named"):
        check_shard_shapes(params, {"model.layers.9.mlp.down_proj.weight": (64, 24)}, tp_rank=0, expected=0)
    megatron_rows = {"lm_head.weight": (128, 64)}  # 250 padded to 128 x 4 instead of 64
    with pytest.raises(
        VLLMWeightError, match=r"lm_head.weight: shard shape \(128, 64\) != vLLM's \(64, 64\)"
    ):
        check_shard_shapes(params, megatron_rows, tp_rank=0, expected=0)


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


def _vllm_reshard(train_tp: int, tp_g: int, family: str) -> list[str]:
    """Every rank's resharded, renamed tensors vs vLLM's slicing of the full state; returns the mismatches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = tiny_arch(family, num_key_value_heads=4)
    full = random_full_state(arch)
    train = ParallelLayout(world, tp=train_tp)
    plan = build_vllm_plan(arch, train, tp_g)
    me = train.coords(rank).tp
    local = {
        s.name: tp_shard(full[s.name], s.kind, me, train_tp, padded_rows(s, train_tp))
        for s in plan.specs.values()
    }
    out, _ = execute_plan(plan, local)
    got = {vllm_param_name(n): t for n, t in rollout_tensors(out, arch)}
    coord = rank % tp_g  # vLLM's TP rank
    check_shard_shapes(
        vllm_param_shapes(arch, tp_g),
        {n: tuple(t.shape) for n, t in got.items()},
        tp_rank=coord,
        expected=plan.rollout_coords[rank][0],
    )
    expected = {vllm_param_name(n): t for n, t in rollout_shards_from_full(full, arch, tp_g, coord).items()}
    padded = vllm_padded_vocab(arch.vocab_size)
    for name, key in (
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ):
        if key in full:  # vLLM's rows: vocab padded to 64 at the end, equal blocks
            rows = torch.cat([full[key], full[key].new_zeros(padded - arch.vocab_size, arch.hidden_size)])
            expected[name] = rows.chunk(tp_g)[coord]
    assert set(got) == set(expected) == set(vllm_param_shapes(arch, tp_g))
    return [name for name in got if not torch.equal(got[name], expected[name])]


def test_unseeded_requests_share_the_first_ranks_seed(run_distributed) -> None:
    first, second = run_distributed(_seeds)
    assert first == second and first[2] == 17 and first[0] != first[1]


@pytest.mark.parametrize(("train_tp", "tp_g", "family"), [(2, 4, "llama"), (1, 2, "qwen2")])
def test_executed_vllm_plan_gives_vllms_shards(
    run_distributed, train_tp: int, tp_g: int, family: str
) -> None:
    """The R3 case: train TP2 -> rollout TP4 on 4 ranks, vocab 250 (vLLM: 64 rows a rank; megatron: 128)."""
    assert run_distributed(_vllm_reshard, train_tp, tp_g, family, world_size=4) == [[]] * 4
