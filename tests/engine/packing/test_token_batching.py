"""Token-budget batching: the pure partition functions, and parity with the padded path at DP2.

The parity test runs the real actor worker (``HybridWorker.update``) on two gloo ranks twice from the same
weights: rows per micro-batch (padded to the batch width) and a token budget (rows dealt to the ranks by
tokens, micro-batches by the budget, each trimmed to its longest row). The step's metrics, the last
mini-batch's gradients and the updated weights agree within 1e-5 (fp32).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.controller.dispatch import split_record
from mcore_rl.engine.packing.token_batching import (
    balanced_order,
    balanced_partitions,
    budget_micro_batches,
    row_lengths,
    select_rows,
)
from mcore_rl.types import TrainBatch

ROWS, WIDTH, PROMPT = 16, 22, 4
LENGTHS = [1, 17, 2, 3, 16, 15, 2, 4, 1, 14, 3, 2, 17, 5, 2, 1]  # response tokens per row, skewed


def test_balanced_partitions_have_equal_counts_and_balanced_tokens() -> None:
    lengths = [100, 90, 5, 5, 4, 3, 80, 2]
    parts = balanced_partitions(lengths, 2)
    assert sorted(r for p in parts for r in p) == list(range(8)) and [len(p) for p in parts] == [4, 4]
    sums = [sum(lengths[r] for r in p) for p in parts]
    assert abs(sums[0] - sums[1]) <= max(lengths)
    assert abs(sums[0] - sums[1]) < abs(sum(lengths[:4]) - sum(lengths[4:]))  # better than contiguous
    with pytest.raises(ValueError, match="7 rows do not split into 2"):
        balanced_partitions(lengths[:7], 2)


def test_balanced_order_keeps_every_mini_batch_and_balances_its_ranks() -> None:
    lengths = [int(x) for x in torch.randint(1, 50, (24,), generator=torch.Generator().manual_seed(3))]
    order = balanced_order(lengths, num_mini_batches=3, num_ranks=2)
    assert sorted(order) == list(range(24))

    def minis(rows: list[int]) -> list[set[int]]:  # mini-batch k: slice k of each of 2 contiguous shards
        return [set(rows[k * 4 : k * 4 + 4]) | set(rows[12 + k * 4 : 12 + k * 4 + 4]) for k in range(3)]

    assert minis(order) == minis(list(range(24)))
    for k in range(3):
        sums = [sum(lengths[r] for r in order[s + k * 4 : s + k * 4 + 4]) for s in (0, 12)]
        assert abs(sums[0] - sums[1]) <= max(lengths)


def test_budget_micro_batches_respect_the_budget_and_cover_every_row_once() -> None:
    lengths = [30, 3, 7, 12, 12, 5, 60, 1]
    groups = budget_micro_batches(lengths, budget=40)
    assert sorted(r for g in groups for r in g) == list(range(8))
    assert [6] in groups and [0] in groups  # a row over the budget, or filling it, goes alone
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[r] for r in group) <= 40
    assert len(budget_micro_batches(lengths, budget=10**6)) == 1


def test_row_lengths_end_at_the_last_response_token() -> None:
    mask = torch.zeros(3, 8)
    mask[0, 2:5] = 1  # last response token at column 5
    mask[2, 6] = 1
    assert row_lengths(mask).tolist() == [6, 1, 8]


def _train_batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 14, (ROWS, WIDTH), generator=generator)
    mask = torch.zeros(ROWS, WIDTH)
    for row, n in enumerate(LENGTHS):
        mask[row, PROMPT - 1 : PROMPT - 1 + n] = 1.0
        if n >= 6:  # a multi-turn row: tool tokens between the model's turns, off the mask
            mask[row, PROMPT + 1 : PROMPT + 3] = 0.0
        tokens[row, PROMPT + n :] = 0  # right padding
    old = -2.5 + 0.3 * torch.randn(ROWS, WIDTH, generator=generator)
    advantages = torch.randn(ROWS, 1, generator=generator).expand(ROWS, WIDTH).contiguous()
    ref = old + 0.1 * torch.randn(ROWS, WIDTH, generator=generator)
    return TrainBatch(tokens, mask, old * mask, advantages * mask, ref * mask)


def _update_both_ways(spec, settings) -> dict:
    import torch.distributed as dist

    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from tests.trainer.common import built_worker

    batch, rank = _train_batch(), dist.get_rank()
    order = balanced_order(row_lengths(batch.response_mask).tolist(), 2, 2)
    packing = dataclasses.replace(spec, remove_padding=True)
    runs = {
        "padded": (batch, None, spec),
        "budget": (select_rows(batch, order), 48, spec),
        "packed": (batch, None, packing),  # fixed micro-batches, each packed end to end
        "budget_packed": (select_rows(batch, order), 48, packing),
    }
    out: dict = {}
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        initial = None
        for name, (global_batch, budget, run_spec) in runs.items():
            worker, initial = built_worker(ctx, run_spec, initial)
            params = dict(worker.engine.models[0].named_parameters())
            shard = split_record(global_batch, 2)[rank]
            stats = worker.update(shard, settings, 2, 1, 2, "stop", budget)
            grads = {k: p.main_grad.detach().clone() for k, p in params.items()}
            weights = {k: p.detach().clone() for k, p in params.items()}
            out[name] = (stats, grads, weights)
    return out


def test_token_budget_update_equals_the_padded_update_at_dp2(run_distributed, tmp_path) -> None:
    from mcore_rl.engine.workers.losses import PolicyLossSettings
    from mcore_rl.trainer.build import worker_spec
    from tests.trainer.common import tiny_run_config

    # Without ZeRO every rank's main_grad holds the whole all-reduced gradient after the step.
    # adam_eps 1e-3: with the default 1e-8 Adam's first steps move every weight by about lr * sign(grad), so a
    # 1e-8 rounding difference in a near-zero gradient (different attention lengths) flips a whole lr step
    cfg = tiny_run_config(
        str(tmp_path), ["optim.lr=1e-2", "optim.use_distributed_optimizer=false", "optim.adam_eps=1e-3"]
    )
    spec = dataclasses.replace(worker_spec(cfg, total_optimizer_steps=2), with_reference=False)
    settings = PolicyLossSettings(vocab_size=14, temperature=1.0, use_kl_loss=True, entropy_coeff=0.01)
    lengths = row_lengths(_train_batch().response_mask).tolist()
    order = balanced_order(lengths, 2, 2)
    assert order != sorted(order)  # the ranks get other rows than the padded path's
    micro = budget_micro_batches([lengths[i] for i in order[:4]], 48)  # rank 0's first mini-batch
    assert len(micro) > 1 and max(max(lengths[order[i]] for i in g) for g in micro) < WIDTH
    results = run_distributed(_update_both_ways, spec, settings)
    for per_rank in results:
        padded, g0, w0 = per_rank["padded"]
        assert any(g.abs().max() > 0 for g in g0.values())
        for mode in ("budget", "packed", "budget_packed"):
            other, g1, w1 = per_rank[mode]
            # at DP2 (TP1, PP1) every rank owns the step's stats (reduced over both): none returns None
            assert padded is not None and other is not None, mode
            assert padded.num_optimizer_steps == other.num_optimizer_steps == 2
            for field in ("pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "grad_norm"):
                a, b = getattr(padded, field), getattr(other, field)
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (mode, field, a, b)
            assert padded.grad_norm > 0 and padded.pg_loss != 0
            for name in g0:
                assert (g0[name] - g1[name]).abs().max() <= 1e-5, (mode, name)
                assert (w0[name] - w1[name]).abs().max() <= 1e-5, (mode, name)
    first, second = results[0]["padded"][1], results[1]["padded"][1]
    assert all(torch.equal(first[k], second[k]) for k in first)  # the gradients compared are the global ones


def test_packed_seq_params_mark_where_each_row_starts() -> None:
    """The TE path's packing metadata (built here; the packed forward itself needs TE on a GPU)."""
    from mcore_rl.engine.packing.token_batching import packed_seq_params

    params = packed_seq_params([3, 5, 2])
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 8, 10]
    assert params.max_seqlen_q == 5 and params.cu_seqlens_kv.tolist() == [0, 3, 8, 10]


def test_the_driver_step_with_a_token_budget_equals_the_padded_step(tmp_path) -> None:
    """Through the trainer (in-process): ``algorithm.ppo_max_token_len_per_gpu`` reaches the worker and
    the step's metrics equal the fixed-size micro-batch run's within 1e-5."""
    from tests.trainer.common import MIXED_REWARD, QUIET, rl_records

    def records(name: str, extra: list[str]) -> list[dict]:
        overrides = [
            MIXED_REWARD,
            *QUIET,
            "trainer.total_training_steps=2",
            "algorithm.ppo_micro_batch_size_per_gpu=4",
            *extra,
        ]

        def budget_reaches_the_update(trainer) -> None:  # what ActorGroup.update gets
            assert trainer.step.plan.token_budget == (40 if extra else None)

        return rl_records(str(tmp_path / "data"), tmp_path / name, overrides, budget_reaches_the_update)

    padded = records("padded", [])
    budget = records("budget", ["algorithm.ppo_max_token_len_per_gpu=40"])
    for want, have in zip(padded, budget, strict=True):
        for key in ("pg_loss", "kl_loss", "entropy", "clip_frac", "grad_norm", "reward", "response_len"):
            assert have[key] == pytest.approx(want[key], abs=1e-5), key
    assert padded[1]["reward"] != padded[0]["reward"] or padded[1]["pg_loss"] != padded[0]["pg_loss"]


def test_balanced_order_moves_whole_groups_and_balances_them() -> None:
    # 2 mini-batches x 2 ranks, groups of 3 rows (one prompt's samples): 4 groups per mini-batch
    lengths = [int(x) for x in torch.randint(1, 60, (24,), generator=torch.Generator().manual_seed(5))]
    order = balanced_order(lengths, num_mini_batches=2, num_ranks=2, group_size=3)
    assert sorted(order) == list(range(24))
    groups = [order[i : i + 3] for i in range(0, 24, 3)]
    assert all(g == list(range(g[0], g[0] + 3)) and g[0] % 3 == 0 for g in groups)  # whole, in place

    def minis(rows: list[int]) -> list[set[int]]:  # mini-batch k: slice k of each of 2 contiguous shards
        return [set(rows[k * 6 : k * 6 + 6]) | set(rows[12 + k * 6 : 12 + k * 6 + 6]) for k in range(2)]

    assert minis(order) == minis(list(range(24)))
    weight = [sum(lengths[g : g + 3]) for g in range(0, 24, 3)]
    for k in range(2):
        sums = [sum(lengths[r] for r in order[s + k * 6 : s + k * 6 + 6]) for s in (0, 12)]
        assert abs(sums[0] - sums[1]) <= max(weight)
    with pytest.raises(ValueError, match="of whole groups of 4"):
        balanced_order(lengths, 2, 2, group_size=4)  # 6 rows per rank and mini-batch


def test_balance_applies_to_whole_groups_on_more_than_one_rank() -> None:
    from mcore_rl.trainer.groups.actor import balances_groups

    assert balances_groups(32, 1, 2, 4)
    assert not balances_groups(32, 1, 2, None)  # trainer.balance_batch=false
    assert not balances_groups(32, 1, 1, 4)  # one rank
    assert not balances_groups(24, 1, 2, 8)  # 12 rows per rank: one group and a half
