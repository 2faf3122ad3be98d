"""Context parallelism through the train engine: the actor's PPO loss (the fused LM-head op on each CP shard)
and the critic's value loss give the same loss, metrics and gradients at CP2 as at CP1, for padded and packed
rows, and the forward-only log-probs, entropy and values are the same rows on every CP rank.

Each case builds the same weights twice in one world, at CP1 (every rank a DP replica) and at CP2 (pairs of
ranks splitting each sequence), runs one forward-backward over the same global batch and compares every
parameter's reduced gradient on the same rank (the same TP shard in both layouts).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.context_parallel import context_shards
from mcore_rl.engine.model import ModelOptions, build_model_chunks
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.micro_batches import packed, positions
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.engine.workers.losses import (
    LogProbMicroBatch,
    PolicyLossSettings,
    PolicyMicroBatch,
    ValueMicroBatch,
    critic_loss,
    forward_values_loss,
    log_prob_loss,
    policy_loss,
)
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import TrainBatch, ValueBatch
from tests.models import tiny_arch

ROWS, SEQ = 4, 32
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False)  # every rank: whole grads


def _batch(vocab: int) -> tuple[TrainBatch, ValueBatch]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, vocab, (ROWS, SEQ), generator=g)
    mask = torch.zeros(ROWS, SEQ)
    for row, (start, end) in enumerate(
        [(5, 30), (8, 17), (3, 12), (10, 26)]
    ):  # responses of different lengths
        mask[row, start:end] = 1.0
        tokens[row, end + 1 :] = 0  # right padding after each row
    noise = torch.randn(ROWS, SEQ, generator=g)
    train = TrainBatch(
        tokens=tokens,
        response_mask=mask,
        old_log_probs=(-3.0 + 0.3 * noise) * mask,
        advantages=torch.randn(ROWS, SEQ, generator=g) * mask,
        ref_log_probs=(-3.2 + 0.3 * noise) * mask,
    )
    values = ValueBatch(tokens, mask, 0.1 * noise * mask, torch.randn(ROWS, SEQ, generator=g) * mask)
    return train, values


def _rows(ctx: ParallelContext) -> slice:
    per = ROWS // ctx.dp_size
    return slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)


def _micro(mb: MicroBatch, mask: torch.Tensor, ctx: ParallelContext, remove_padding: bool) -> MicroBatch:
    return packed(mb, mask, ctx.sequence_multiple, 0, remove_padding=remove_padding)


def _grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {
        name: p.main_grad.detach().clone()
        for chunk in engine.chunks
        for name, p in chunk.named_parameters()
        if p.requires_grad
    }


def _actor_pass(ctx, arch, full, train, remove_padding) -> dict:
    """One policy forward-backward of this rank's rows (micro-batches of 1 row) and the log-probs of every
    row (forward only): loss, metrics, gradients, log-probs, entropy."""
    engine = TrainEngine.build(arch, ctx, ModelOptions(), OPTIM)
    engine.load_full_state(full)
    settings = PolicyLossSettings(
        vocab_size=arch.vocab_size, temperature=0.9, use_kl_loss=True, entropy_coeff=0.01
    )
    mask = train.response_mask
    counts = torch.tensor([float(mask.sum()), float((mask.sum(1) > 0).sum())])
    mine = _rows(ctx)
    micro = [
        _micro(PolicyMicroBatch(t, positions(t), train=TrainBatch(t, m, o, a, r)), m, ctx, remove_padding)
        for t, m, o, a, r in zip(
            *(
                x[mine].split(1)
                for x in (train.tokens, mask, train.old_log_probs, train.advantages, train.ref_log_probs)
            ),
            strict=True,
        )
    ]
    engine.zero_grad()
    out = engine.forward_backward(micro, policy_loss(settings, counts[0], counts[1]))
    metrics = _summed(out, ctx)
    every = [
        _micro(LogProbMicroBatch(t, positions(t), mask=m), m, ctx, remove_padding)
        for t, m in zip(train.tokens.split(2), mask.split(2), strict=True)
    ]
    forward = engine.forward_backward(every, log_prob_loss(arch.vocab_size, 0.9), forward_only=True)
    return {
        "metrics": metrics,
        "grads": _grads(engine),
        "log_probs": torch.cat([m.log_probs for m in forward]) if forward else None,  # last stage only
        "entropy": torch.cat([m.entropy for m in forward]) if forward else None,
    }


def _summed(out: list, ctx: ParallelContext) -> torch.Tensor | None:
    """The micro-batches' metrics summed over DP, as the actor does (CP ranks hold the same); None before
    the last pipeline stage."""
    if not out:
        return None
    metrics = torch.stack([m.summable() for m in out]).sum(0)
    dist.all_reduce(metrics, group=ctx.dp_group)
    return metrics


def _critic_pass(ctx, arch, full, values, remove_padding) -> dict:
    engine = TrainEngine.build(arch, ctx, ModelOptions(value_head=True), OPTIM)
    head = 0.05 * torch.randn(1, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    engine.load_full_state(
        {**{k: v for k, v in full.items() if not k.startswith("output_layer")}, "output_layer.weight": head}
    )
    mine, mask = _rows(ctx), values.response_mask
    micro = [
        _micro(ValueMicroBatch(t, positions(t), values=ValueBatch(t, m, o, r)), m, ctx, remove_padding)
        for t, m, o, r in zip(
            *(x[mine].split(1) for x in (values.tokens, mask, values.old_values, values.returns)), strict=True
        )
    ]
    engine.zero_grad()
    out = engine.forward_backward(micro, critic_loss(0.2, mask.sum()))
    metrics = _summed(out, ctx)
    every = [
        _micro(ValueMicroBatch(t, positions(t)), m, ctx, remove_padding)
        for t, m in zip(values.tokens.split(2), mask.split(2), strict=True)
    ]
    forward = engine.forward_backward(every, forward_values_loss(), forward_only=True)
    values_out = torch.cat([m.values for m in forward]) if forward else None
    return {"metrics": metrics, "grads": _grads(engine), "values": values_out}


def _parity_run(
    family: str, tp: int, cp: int, remove_padding_cases: tuple[bool, ...], sp: bool = False, pp: int = 1
) -> list[dict]:
    arch = tiny_arch(family)
    train, values = _batch(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    results = []
    for remove_padding in remove_padding_cases:
        result = {}
        for name, size in (("cp1", 1), ("cp", cp)):
            config = ParallelConfig(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                context_parallel_size=size,
                sequence_parallel=sp,
            )
            with ParallelContext.initialize(config) as ctx:
                result[name] = {
                    "actor": _actor_pass(ctx, arch, full, train, remove_padding),
                    "critic": _critic_pass(ctx, arch, full, values, remove_padding),
                }
        results.append(result)
    return results


def _max_diffs(one: dict, other: dict) -> dict[str, float]:
    diffs = {}
    for role in ("actor", "critic"):
        a, b = one[role], other[role]
        for key in a:
            if key == "grads":
                assert a[key].keys() == b[key].keys()
                diffs[f"{role}.grads"] = max(float((a[key][n] - b[key][n]).abs().max()) for n in a[key])
            elif a[key] is not None or b[key] is not None:  # None: a stage before the last
                diffs[f"{role}.{key}"] = float((a[key] - b[key]).abs().max())
    return diffs


def _check(per_rank: list[list[dict]]) -> None:
    for rank_results in per_rank:
        for result in rank_results:
            diffs = _max_diffs(result["cp1"], result["cp"])
            assert max(diffs.values()) <= 1e-5, diffs
            grads = result["cp1"]["actor"]["grads"]
            assert sum(float(g.abs().sum()) for g in grads.values()) > 1.0  # the comparison is not of zeros
            log_probs = result["cp1"]["actor"]["log_probs"]
            assert log_probs is None or float(log_probs.abs().sum()) > 1.0


def test_cp2_equals_cp1_padded_and_packed(run_distributed):
    # world 2: CP1 is DP2, CP2 is one pair splitting every sequence; padded rows, then packed (thd) rows
    _check(run_distributed(_parity_run, "llama", 1, 2, (False, True), world_size=2))


def test_cp2_tp2_equals_cp1_tp2(run_distributed):
    # world 4: TP2 x DP2 against TP2 x CP2, the same TP shard on each rank; padded rows only here
    _check(run_distributed(_parity_run, "llama", 2, 2, (False,), world_size=4))


@pytest.mark.sweep
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_cp2_tp2_packed_and_sequence_parallel(run_distributed, sp):
    _check(run_distributed(_parity_run, "llama", 2, 2, (False, True), sp, world_size=4))


@pytest.mark.sweep
def test_cp2_pp2_equals_cp1_pp2(run_distributed):
    # world 4: PP2 x DP2 against PP2 x CP2 (padded rows: packed ones need PP1), each rank the same stage
    _check(run_distributed(_parity_run, "llama", 1, 2, (False,), False, 2, world_size=4))


@pytest.mark.sweep
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_cp2_tied_embeddings_bias_and_sliding_window(run_distributed, family):
    # Mistral's sliding window (8) against megatron's own windowed attention: padded rows only, as packed rows
    # with a window are refused at CP1 (compat/cpu_layers.py)
    cases = (False,) if family == "mistral" else (False, True)
    _check(run_distributed(_parity_run, family, 1, 2, cases, world_size=2))


def _refusals() -> list[str]:
    messages = []
    with ParallelContext.initialize(ParallelConfig(context_parallel_size=2)) as ctx:
        tokens = torch.ones(2, 30, dtype=torch.long)  # 30 columns: not a multiple of 2 x CP = 4
        mask = torch.ones(2, 30)
        for micro in (
            MicroBatch(tokens, positions(tokens)),
            packed(
                MicroBatch(tokens, positions(tokens)),
                mask,
                4,
                0,
                remove_padding=True,
                share_prompt_prefix=True,
            ),
        ):
            try:
                context_shards([micro], ctx)
                messages.append("no error")
            except ValueError as err:
                messages.append(str(err))
    return messages


def test_rows_that_do_not_split_and_shared_prompts_are_refused(run_distributed):
    for width, shared in run_distributed(_refusals, world_size=2):
        assert "30 columns does not split over context_parallel_size=2" in width and "= 4" in width
        assert "model.share_prompt_prefix does not support context parallelism" in shared


def test_token_budgets_count_tokens_per_gpu_under_cp():
    # ppo_max_token_len_per_gpu=8 at CP2: a GPU runs half of each row, so a micro-batch holds up to 16 tokens
    # (the CP1 grouping at 16), its width rounded up to 2 x CP = 4
    from mcore_rl.engine.packing.micro_batches import micro_parts
    from mcore_rl.parallel.layout import ParallelLayout

    mask = torch.zeros(4, 16)
    for row, n in enumerate([3, 5, 2, 6]):  # rows need 4, 6, 3 and 7 columns
        mask[row, :n] = 1.0
    batch = TrainBatch(torch.ones(4, 16, dtype=torch.long), mask, mask.clone(), mask.clone(), mask.clone())
    cp2 = micro_parts(ParallelLayout(2, cp=2), batch, 1, token_budget=8)
    cp1 = micro_parts(ParallelLayout(1), batch, 1, token_budget=16)
    assert [rows for rows, _ in cp2] == [rows for rows, _ in cp1] == [[1, 3], [0, 2]]
    assert [part.tokens.shape[1] for _, part in cp1] == [7, 4]
    assert [part.tokens.shape[1] for _, part in cp2] == [8, 4]  # 7 columns padded to the multiple
