"""bench/bench_grpo_step.py's step model (``bench/grpo_step_limits.py``): FLOPs, GEMM shapes and limits
agree with each other and with hand-computed figures for the realistic model (h512, 8 layers, 8 query heads
/ 2 KV heads, vocab 32000)."""

from __future__ import annotations

import types

import pytest
import torch

from bench.grpo_step_limits import (
    WORKLOADS,
    gemm_flops,
    gemm_shapes,
    linear_shapes,
    param_count,
    phase_limits,
    rollout_gemm_shapes,
    rollout_limit,
    step_flops,
)
from mcore_rl.engine.arch import ModelArch

N, PROMPT, NEW, SAMPLES = 64, 16, 128, 8


def _arch(model: str) -> ModelArch:
    return ModelArch.from_hf_config(WORKLOADS[model]["hf_config"])


def _attention(arch: ModelArch, seq: int) -> float:
    return 4.0 * arch.num_layers * arch.hidden_size * seq * (seq + 1) / 2


def test_key_and_value_projections_use_the_kv_heads() -> None:
    # 8 query heads of 64 + 2 x 2 KV heads of 64
    assert linear_shapes(_arch("realistic")) == [(512, 768), (512, 512), (512, 2752), (1376, 512)]
    assert linear_shapes(_arch("tiny"))[0] == (256, 3 * 256)  # issue 17's model is MHA


def test_param_count_by_hand() -> None:
    per_layer = 512 * 768 + 512 * 512 + 512 * 2752 + 1376 * 512 + 2 * 512
    assert param_count(_arch("realistic")) == 8 * per_layer + 2 * 32000 * 512 + 512


def test_gemm_shapes_hold_the_step_flops_and_the_lm_head() -> None:
    arch = _arch("realistic")
    flops = step_flops(arch, N, PROMPT, NEW, SAMPLES)
    shapes = gemm_shapes(arch, N, PROMPT, NEW)
    attention = _attention(arch, PROMPT + NEW)
    # training: forward, input-gradient and weight-gradient GEMMs are the update's FLOPs less attention's
    assert gemm_flops(shapes["train"]) == pytest.approx(flops["update"] - 3 * N * attention)
    responses = N * NEW
    assert {(responses, 512, 32000, 1), (responses, 32000, 512, 1), (512, responses, 32000, 1)} <= set(
        shapes["train"]
    )
    # generation as the engine runs it: each of the N / SAMPLES prompts prefilled once (its linears, causal
    # attention and one head row), then NEW - 1 decode steps of all N rows, step i attending to PROMPT + i keys
    per_token = 2 * 8 * sum(k * c for k, c in linear_shapes(arch))
    head = 2 * 512 * 32000
    prefill = N // SAMPLES * (PROMPT * per_token + _attention(arch, PROMPT) + head)
    decode_attention = N * sum(4.0 * 8 * 512 * (PROMPT + i) for i in range(1, NEW))
    assert flops["generate_prefill"] == pytest.approx(prefill)
    assert (NEW - 1) * gemm_flops(shapes["decode"]) == pytest.approx(
        flops["generate_decode"] - decode_attention
    )
    assert flops["generate"] == pytest.approx(prefill + flops["generate_decode"])
    assert (N, 512, 32000, 1) in shapes["decode"]
    assert flops["generate"] / 1e9 == pytest.approx(643.03, abs=0.01)  # the workload, by hand above


def test_shared_prefix_skips_the_prompt_copies() -> None:
    arch = _arch("realistic")
    flops = step_flops(arch, N, PROMPT, NEW, SAMPLES)
    per_token = 2 * 8 * sum(k * c for k, c in linear_shapes(arch))
    skipped = (N - N // SAMPLES) * PROMPT * per_token
    assert flops["log_probs"] - flops["log_probs_shared"] == pytest.approx(skipped)
    assert flops["update_shared"] == pytest.approx(3 * flops["log_probs_shared"])


def test_phase_limits() -> None:
    flops = {"generate": 2e9, "log_probs": 1e9, "update": 3e9}
    limits = phase_limits(flops, {"decode": 10.0, "train": 100.0}, 1e9, params=1000, sync_bytes=4000)
    assert limits == pytest.approx(
        # Adam: 7 fp32 arrays of 1000 parameters read or written, at 2 bytes of traffic per byte copied
        {"sync": 4e-6, "generate": 0.2, "log_probs": 0.01, "update": 0.03, "optimizer": 28000 / 2e9}
    )
    # the prompts' prefill runs at training shapes' rate, the decode steps at decode shapes'
    prefilled = phase_limits(
        {**flops, "generate_prefill": 1e9}, {"decode": 10.0, "train": 100.0}, 1e9, 1000, 0
    )
    assert prefilled["generate"] == pytest.approx(0.01 + 0.1)


def test_rollout_shapes_hold_the_generation_flops() -> None:
    """``bench_rollout``'s limit: the prefill GEMMs are each prompt's linears over its tokens and one head row,
    the decode GEMMs one step of every sequence; the FLOPs beside them are attention's."""
    arch, prompts = _arch("realistic"), N // SAMPLES
    flops = step_flops(arch, N, PROMPT, NEW, SAMPLES)
    shapes = rollout_gemm_shapes(arch, prompts, PROMPT, N)
    assert gemm_flops(shapes["prefill"]) == pytest.approx(
        flops["generate_prefill"] - prompts * _attention(arch, PROMPT)
    )
    assert shapes["decode"] == gemm_shapes(arch, N, PROMPT, NEW)["decode"]
    assert (prompts * PROMPT, 512, 768, 8) in shapes["prefill"] and (prompts, 512, 32000, 1) in shapes[
        "prefill"
    ]
    seconds = rollout_limit(flops, {"prefill": 100.0, "decode": 10.0})
    assert seconds == pytest.approx(flops["generate_prefill"] / 100e9 + flops["generate_decode"] / 10e9)


def _update_grads(micro_batch_tokens: int | None) -> dict[str, torch.Tensor]:
    """One bench step of ours on the tiny workload (4 prompts x 4 samples x 8 new tokens) up to the optimizer,
    the gradients it left."""
    import argparse

    from bench.bench_grpo_step import Ours
    from bench.grpo_step_limits import WORKLOADS
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    torch.manual_seed(0)
    workload = WORKLOADS["tiny"]
    args = argparse.Namespace(
        hf_config=dict(workload["hf_config"]),
        n=4,
        new_tokens=8,
        share_prompt_prefix=True,
        micro_batch_tokens=micro_batch_tokens,
    )
    prompts = torch.randint(1, args.hf_config["vocab_size"], (4, 6))
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        ours = Ours(ctx, args)
        ours.engine.step = lambda: None  # stop before the optimizer: the gradients are the update's result
        ours.step(prompts, seed=3)
        grads = {}
        for name, param in ours.engine.models[0].named_parameters():
            grad = getattr(param, "main_grad", None)
            grads[name] = (param.grad if grad is None else grad).detach().clone()
        return grads


def _split_rows(micro_batch_tokens: int | None, rows: int, width: int) -> list[tuple[int, int]]:
    from bench.bench_grpo_step import Ours

    me = types.SimpleNamespace(args=types.SimpleNamespace(micro_batch_tokens=micro_batch_tokens, n=4))
    return [(r.start, r.stop) for r in Ours._micro_rows(me, rows, width)]


def test_micro_batch_tokens_splits_whole_groups() -> None:
    assert _split_rows(None, 16, 14) == [(0, 16)]
    assert _split_rows(8 * 14, 16, 14) == [(0, 8), (8, 16)]  # two groups of 4 rows x 14 tokens fit
    assert _split_rows(10, 16, 14) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # at least one group
    assert _split_rows(12 * 14, 16, 14) == [(0, 12), (12, 16)]


def test_micro_batched_update_leaves_the_gradients_of_one_micro_batch(run_distributed) -> None:
    """``--micro-batch-tokens`` splits the update, not its result: the loss is normalised over the whole
    batch's tokens, so the accumulated gradients equal the single micro-batch's (fp32 summation order)."""
    whole, split = run_distributed(_both_grads, world_size=1)[0]
    assert whole.keys() == split.keys()
    assert all(float(g.abs().sum()) > 0 for g in whole.values())  # every parameter took part
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)


def _both_grads() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _update_grads(None), _update_grads(2 * 4 * 14)
