"""Layout parity: the same weights and global batch give the same logits, loss, grad norm and update in every
(TP, PP, VPP, SP, DP) layout, compared with a plain single-process PyTorch step on one rank.

Each case runs megatron's real schedules, DDP and (distributed) optimizer through ``TrainEngine``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from mcore_rl.compat.grad_reduce import REDUCER_ATTR
from mcore_rl.engine.model import ModelOptions, build_model_chunks
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import gather_full_state, load_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import LabeledMicroBatch, tiny_arch

GLOBAL_BATCH, SEQ, LR = 4, 16, 1e-3
OPTIM = OptimConfig(lr=LR, clip_grad=1.0, weight_decay=0.0)


def _global_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _full_logits(output: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(output.float())


def _without_vocab_padding(output: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padding columns (global id >= vocab_size) must not enter the softmax."""
    from megatron.core import parallel_state

    shard = output.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * shard
    columns = torch.arange(first, first + shard)
    return output.float().masked_fill(columns >= vocab_size, float("-inf"))


def _ce_loss(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = _without_vocab_padding(output, mb.vocab_size)
    # megatron's vocab-parallel CE wants [s, b, V/tp] logits and [s, b] labels.
    per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), mb.labels.t().contiguous())
    loss = per_token.sum() / (GLOBAL_BATCH * SEQ)  # this micro-batch's share of the global token mean
    return loss, {"loss": loss.detach().clone()}


def _collect_logits(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return output.sum() * 0.0, {"logits": _full_logits(output).detach(), "index": mb.index}


def _reference(arch, ctx, full, tokens, labels) -> dict:
    """Plain PyTorch on one rank: whole batch, autograd, torch AdamW with the same clipping."""
    model = build_model_chunks(arch, ctx)[0]
    load_full_state([model], full, arch, ctx)
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)
    logits = model(tokens, positions, None)[..., : arch.vocab_size]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, arch.vocab_size), labels.reshape(-1))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    optimizer.step()
    with torch.no_grad():
        after = model(tokens, positions, None)[..., : arch.vocab_size]
        loss_after = torch.nn.functional.cross_entropy(after.reshape(-1, arch.vocab_size), labels.reshape(-1))
    return {
        "logits": logits.detach(),
        "loss": loss.item(),
        "grad_norm": float(grad_norm),
        "loss_after": loss_after.item(),
    }


def _dp_slice_batches(ctx, tokens, labels, vocab_size) -> list[MicroBatch]:
    per_rank = GLOBAL_BATCH // ctx.dp_size
    return row_batches(
        tokens, labels, vocab_size, range(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
    )


def row_batches(tokens, labels, vocab_size, rows) -> list[MicroBatch]:
    """One micro-batch per row of the global batch, each knowing its row index."""
    positions = torch.arange(SEQ).expand(1, SEQ)
    return [
        LabeledMicroBatch(
            tokens[i : i + 1],
            positions,
            labels=labels[i : i + 1],
            index=torch.tensor(i),
            vocab_size=vocab_size,
        )
        for i in rows
    ]


def _sum_over_dp(ctx, metrics: list[dict]) -> float:
    total = torch.tensor(sum(float(m["loss"]) for m in metrics), dtype=torch.float64)
    dist.all_reduce(total, group=ctx.dp_group)
    return float(total)


def _layout_run(
    family: str, parallel: dict, dtype: torch.dtype = torch.float32, optim: OptimConfig = OPTIM
) -> dict:
    arch = tiny_arch(family)
    tokens, labels = _global_batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig()) as ctx:  # TP1 source of truth + reference
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
        reference = _reference(arch, ctx, full, tokens, labels) if dist.get_rank() == 0 else None
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(dtype=dtype), optim)
        engine.load_full_state(full)
        batches = _dp_slice_batches(ctx, tokens, labels, arch.vocab_size)
        logits = engine.forward_backward(batches, _collect_logits, forward_only=True)
        step, metrics = engine.train_step(batches, _ce_loss)
        after = engine.forward_backward(batches, _ce_loss, forward_only=True)
        result = {"reference": reference, "grad_norm": step.grad_norm, "last_stage": ctx.is_last_stage}
        result["host_reduced"] = sum(  # bucket groups whose all-reduce goes through shared memory
            hasattr(group, REDUCER_ATTR) for chunk in engine.chunks for group in chunk.bucket_groups
        )
        if ctx.is_last_stage:
            result["logits"] = {int(m["index"]): m["logits"][0, :, : arch.vocab_size] for m in logits}
        # Every rank of the DP group must join the reduction; only the last stage holds losses.
        result["loss"] = _sum_over_dp(ctx, metrics) if ctx.is_last_stage else None
        result["loss_after"] = _sum_over_dp(ctx, after) if ctx.is_last_stage else None
        return result


def _check(results: list[dict], atol: float) -> dict:
    reference = results[0]["reference"]
    logits = {i: t for r in results if r["last_stage"] for i, t in r["logits"].items()}
    assert sorted(logits) == list(range(GLOBAL_BATCH))
    diffs = {
        "logits": max(float((logits[i] - reference["logits"][i]).abs().max()) for i in logits),
        "loss": max(abs(r["loss"] - reference["loss"]) for r in results if r["last_stage"]),
        "grad_norm": max(abs(r["grad_norm"] - reference["grad_norm"]) for r in results),
        "loss_after": max(abs(r["loss_after"] - reference["loss_after"]) for r in results if r["last_stage"]),
    }
    for name, diff in diffs.items():
        assert diff <= atol, f"{name} differs by {diff:.3g} (> {atol}): {diffs}"
    assert reference["grad_norm"] > OPTIM.clip_grad  # the clipped path is exercised
    return diffs


CASES_WORLD2 = {
    "tp1-dp2-distopt": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "pp2-vpp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
}


@pytest.mark.parametrize("case", sorted(CASES_WORLD2))
def test_parity_world2_llama(run_distributed, case):
    _check(run_distributed(_layout_run, "llama", CASES_WORLD2[case]), atol=1e-5)


def test_parity_dp2_gradients_through_host_memory(run_distributed):
    """DP2 as CPU runs default to it: the optimizer whole on each rank, the gradients summed through shared
    memory rather than gloo (tp1-dp2-distopt above keeps megatron's reduce-scatter)."""
    whole = dataclasses.replace(OPTIM, use_distributed_optimizer=None)
    results = run_distributed(_layout_run, "llama", {}, optim=whole)
    _check(results, atol=1e-5)
    assert all(r["host_reduced"] > 0 for r in results)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_parity_tied_bias_and_window_under_pp2(run_distributed, family):
    _check(run_distributed(_layout_run, family, {"pipeline_model_parallel_size": 2}), atol=1e-5)


def test_parity_tp2_pp2_sp_world4(run_distributed):
    parallel = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True}
    _check(run_distributed(_layout_run, "llama", parallel, world_size=4), atol=1e-5)
