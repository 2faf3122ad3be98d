"""Shared-prompt packing (``model.share_prompt_prefix``, ``trainer/shared_prefix.py``): the rows that share a
prompt are computed with it once.

The packing and its row maps against a hand-made case; then the real actor worker, at TP1 and at TP2
with sequence parallelism, against the padded path from the same weights: log-probs, entropy, the update's
metrics, every gradient and the SFT loss within 1e-5 (fp32), on GQA with QKV biases; and the driver's GRPO step with the
switch on against the step with it off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.engine.packing.shared_prefix import shared_prefix_packing
from mcore_rl.types import RolloutBatch, TrainBatch


def test_rows_sharing_a_prompt_pack_it_once() -> None:
    tokens = torch.tensor(
        [
            [1, 2, 3, 4, 5, 0],  # prompt [1 2 3], response [4 5]
            [7, 8, 9, 0, 0, 0],  # prompt [7 8], response [9]
            [1, 2, 3, 6, 0, 0],  # prompt [1 2 3], response [6]
            [1, 2, 5, 5, 5, 5],  # a different prompt [1 2] of the same tokens' start
        ]
    )
    mask = torch.zeros(4, 6)
    mask[0, 2:4] = mask[1, 1:2] = mask[2, 2:3] = mask[3, 1:5] = 1.0
    rows = shared_prefix_packing(tokens, mask, multiple=4, pad_token_id=-1)
    assert rows.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 5, 5, 5, 5, -1]
    assert rows.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 0]
    assert rows.segments == (6, 3, 6, 1)  # the last one is filler up to a multiple of 4
    total = rows.tokens.numel()
    gathered = torch.cat([rows.tokens, torch.tensor([0])])[rows.source].view(4, 6)
    assert torch.equal(gathered, tokens)  # every row position reads its own token (0 past the row)
    assert (rows.source[:3] == rows.source[12:15]).all()  # rows 0 and 2 read one copy of their prompt
    # each packed token's output comes from a row position holding it, at its position
    real = rows.home < 24
    assert torch.equal(rows.source[rows.home[real]], torch.arange(total)[real])
    assert torch.equal(rows.home[real] % 6, rows.positions[real])
    assert rows.home[-1] == 24  # the filler is read by no row


def _grpo_rows(generator: torch.Generator) -> tuple[RolloutBatch, TrainBatch]:
    """3 prompts of different lengths x 3 samples of different lengths, right-padded, groups interleaved; the
    longer samples multi-turn (two context tokens between model turns)."""
    width, vocab = 16, 14
    prompts = [torch.randint(1, vocab, (n,), generator=generator) for n in (4, 6, 3)]
    response_lengths = [5, 2, 8, 3, 9, 4, 6, 1, 7]
    tokens = torch.zeros(9, width, dtype=torch.long)
    mask = torch.zeros(9, width)
    for row, n in enumerate(response_lengths):
        prompt = prompts[row % 3]
        p = prompt.numel()
        tokens[row, :p] = prompt
        tokens[row, p : p + n] = torch.randint(1, vocab, (n,), generator=generator)
        mask[row, p - 1 : p - 1 + n] = 1.0
        if n >= 6:  # a multi-turn row: tool tokens between the model's turns are context, off the mask
            mask[row, p + 1 : p + 3] = 0.0
    old = (-2.0 + 0.3 * torch.randn(mask.shape, generator=generator)) * mask
    advantages = torch.randn(9, 1, generator=generator) * mask
    rollout = RolloutBatch(tokens, mask, old, tokens, torch.tensor(response_lengths), torch.arange(9) % 3)
    return rollout, TrainBatch(tokens, mask, old, advantages, old * 0.9)


def _padded_and_shared(spec, settings, tp: int) -> dict:
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.types import SFTBatch
    from tests.trainer.common import built_worker

    rollout, train = _grpo_rows(torch.Generator().manual_seed(3))
    out: dict = {}
    config = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    with ParallelContext.initialize(config) as ctx:
        initial = None
        for name in ("padded", "shared"):
            shared = name == "shared"
            worker, initial = built_worker(
                ctx, dataclasses.replace(spec, share_prompt_prefix=shared), initial
            )
            log_probs = worker.log_probs(rollout, 1.0, 9)
            labels = torch.roll(train.tokens, -1, dims=1)  # SFT rows sharing a prompt share it too
            sft = worker.sft_update(SFTBatch(train.tokens, labels, train.response_mask), 9)
            stats = worker.update(train, settings, 1, 1, 9)  # one mini-batch, one micro-batch of 9 rows
            grads = {k: p.main_grad.clone() for k, p in worker.engine.models[0].named_parameters()}
            out[name] = (log_probs, stats, grads, sft)
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-sp"])
def test_shared_prompts_give_the_padded_log_probs_and_gradients(run_distributed, tmp_path, tp) -> None:
    from mcore_rl.engine.workers.losses import PolicyLossSettings
    from mcore_rl.trainer.build import worker_spec
    from tests.trainer.common import tiny_run_config

    overrides = [
        "optim.lr=1e-3",
        "model.hf_config.num_key_value_heads=2",
        "model.hf_config.attention_bias=true",
    ]
    cfg = tiny_run_config(str(tmp_path), overrides)
    spec = dataclasses.replace(worker_spec(cfg, total_optimizer_steps=4), with_reference=False)
    assert spec.arch.num_query_groups < spec.arch.num_attention_heads and spec.arch.qkv_bias
    settings = PolicyLossSettings(vocab_size=14, temperature=1.0, entropy_coeff=0.01)
    for per_rank in run_distributed(_padded_and_shared, spec, settings, tp, world_size=tp):
        padded, shared = per_rank["padded"], per_rank["shared"]
        if padded[0] is not None:  # TP rank 0 owns the results
            for field in ("actor_log_probs", "entropy"):
                a, b = getattr(padded[0], field), getattr(shared[0], field)
                assert (a - b).abs().max() <= 1e-5, field
                assert a.abs().max() > 0.1, field
            for field in ("pg_loss", "entropy", "clip_frac", "approx_kl", "grad_norm"):
                a, b = getattr(padded[1], field), getattr(shared[1], field)
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), field
            assert padded[1].grad_norm > 0
            assert padded[3]["loss"] == pytest.approx(shared[3]["loss"], abs=1e-5)
        for name, grad in padded[2].items():
            assert (grad - shared[2][name]).abs().max() <= 1e-5, name


def test_the_driver_step_with_shared_prompts_equals_the_padded_step(tmp_path) -> None:
    """GRPO's 4 samples per prompt share it in the actor's update and its old-log-prob pass."""
    from tests.trainer.common import MIXED_REWARD, QUIET, rl_records

    base = [
        MIXED_REWARD,
        *QUIET,
        "trainer.total_training_steps=2",
        "algorithm.ppo_micro_batch_size_per_gpu=8",
        "algorithm.recompute_old_log_probs=always",
    ]
    data = str(tmp_path / "data")
    padded = rl_records(data, tmp_path / "padded", base)
    shared = rl_records(data, tmp_path / "shared", [*base, "model.share_prompt_prefix=true"])
    for want, have in zip(padded, shared, strict=True):
        for key in ("reward", "pg_loss", "entropy", "grad_norm", "token_mult_prob_error"):
            assert have[key] == pytest.approx(want[key], abs=1e-5), key
