"""Packed sequences (``model.use_remove_padding``): a micro-batch's rows laid end to end in one ``thd`` sequence
with megatron's ``PackedSeqParams``, so no padding column is computed.

The packing arithmetic against hand-made cases; then the real actor worker at TP2 with sequence parallelism
(rows of one turn and multi-turn rows whose tool tokens are off the mask)
(the packed length is filled up to a multiple of TP) against the padded path from the same weights: log-probs,
entropy, the update's metrics and gradients and the SFT loss within 1e-5 (fp32); and the driver's step with
the switch on against the step with it off, GRPO and PPO (the critic packs too). The DP2 token-budget parity test (``test_token_batching.py``)
also runs packed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.engine.packing.token_batching import PackedRows, packing_of
from mcore_rl.types import RolloutBatch, TrainBatch


def test_rows_pack_end_to_end_and_unpack_to_their_columns() -> None:
    rows = torch.arange(1, 13).view(3, 4)
    packing = PackedRows.of([2, 4, 1], width=4, multiple=4)
    assert packing.filler == 1 and packing.segments == [2, 4, 1, 1]
    assert packing.pack(rows, fill=-1).tolist() == [[1, 2, 5, 6, 7, 8, 9, -1]]
    assert packing.positions().tolist() == [[0, 1, 0, 1, 2, 3, 0, 0]]
    assert packing.unpack(packing.pack(rows)).tolist() == [[1, 2, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    params = packing.seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 2, 6, 7, 8]
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert packing_of(mask).lengths == (3, 4, 1)  # cut after the last token a mask position predicts


def _rows(generator: torch.Generator) -> tuple[RolloutBatch, TrainBatch]:
    lengths, prompt, width = [5, 1, 9, 3, 7, 2, 9, 4], 3, 14
    tokens = torch.randint(1, 14, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width)
    for row, n in enumerate(lengths):
        mask[row, prompt - 1 : prompt - 1 + n] = 1.0
        if n >= 7:  # a multi-turn row: two tool tokens between two model turns are context, off the mask
            mask[row, prompt + 1 : prompt + 3] = 0.0
        tokens[row, prompt + n :] = 0
    old = (-2.0 + 0.3 * torch.randn(mask.shape, generator=generator)) * mask
    advantages = torch.randn(len(lengths), 1, generator=generator) * mask
    rollout = RolloutBatch(
        tokens, mask, old, tokens[:, prompt:], torch.tensor(lengths), torch.arange(len(lengths))
    )
    return rollout, TrainBatch(tokens, mask, old, advantages, old * 0.9)


def _padded_and_packed(spec, settings) -> dict:
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.types import SFTBatch
    from tests.trainer.common import built_worker

    rollout, train = _rows(torch.Generator().manual_seed(3))
    out: dict = {}
    config = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with ParallelContext.initialize(config) as ctx:
        initial = None
        for name in ("padded", "packed"):
            worker, initial = built_worker(
                ctx, dataclasses.replace(spec, remove_padding=name == "packed"), initial
            )
            log_probs = worker.log_probs(rollout, 1.0, 4)
            labels = torch.roll(train.tokens, -1, dims=1)
            sft = worker.sft_update(SFTBatch(train.tokens, labels, train.response_mask), 4)
            stats = worker.update(train, settings, 2, 1, 2)
            grads = {k: p.main_grad.clone() for k, p in worker.engine.models[0].named_parameters()}
            out[name] = (log_probs, sft, stats, grads)
    return out


def test_packed_passes_equal_the_padded_ones_at_tp2_with_sequence_parallelism(
    run_distributed, tmp_path
) -> None:
    from mcore_rl.engine.workers.losses import PolicyLossSettings
    from mcore_rl.trainer.build import worker_spec
    from tests.trainer.common import tiny_run_config

    cfg = tiny_run_config(str(tmp_path), ["optim.lr=1e-3"])
    spec = dataclasses.replace(worker_spec(cfg, total_optimizer_steps=4), with_reference=False)
    settings = PolicyLossSettings(vocab_size=14, temperature=1.0, entropy_coeff=0.01)
    for per_rank in run_distributed(_padded_and_packed, spec, settings):
        padded, packed = per_rank["padded"], per_rank["packed"]
        if padded[0] is not None:  # TP rank 0 owns the results
            for field in ("actor_log_probs", "entropy"):
                a, b = getattr(padded[0], field), getattr(packed[0], field)
                assert (a - b).abs().max() <= 1e-5, field
            assert padded[1]["loss"] == pytest.approx(packed[1]["loss"], abs=1e-5)
            for field in ("pg_loss", "entropy", "clip_frac", "approx_kl", "grad_norm"):
                a, b = getattr(padded[2], field), getattr(packed[2], field)
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), field
            assert padded[2].grad_norm > 0
        for name, grad in padded[3].items():
            assert (grad - packed[3][name]).abs().max() <= 1e-5, name


def _padded_and_packed_runs(tmp_path, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """The RL records of the same 2-step in-process run with rows padded and packed."""
    from tests.trainer.common import MIXED_REWARD, QUIET, rl_records

    base = [MIXED_REWARD, *QUIET, "trainer.total_training_steps=2", *overrides]
    data = str(tmp_path / "data")
    padded = rl_records(data, tmp_path / "padded", base)
    return padded, rl_records(data, tmp_path / "packed", [*base, "model.use_remove_padding=true"])


def test_the_driver_step_with_packed_rows_equals_the_padded_step(tmp_path) -> None:
    padded, packed = _padded_and_packed_runs(
        tmp_path, ["algorithm.ppo_micro_batch_size_per_gpu=4", "algorithm.recompute_old_log_probs=always"]
    )
    for want, have in zip(padded, packed, strict=True):
        for key in ("reward", "pg_loss", "entropy", "grad_norm", "token_mult_prob_error"):
            assert have[key] == pytest.approx(want[key], abs=1e-5), key


def test_the_ppo_step_with_packed_rows_equals_the_padded_step(tmp_path) -> None:
    """The critic packs too: values, GAE, the value loss and the actor's update equal the padded run's."""
    overrides = [
        "algorithm.adv_estimator=gae",
        "critic.warmup_steps=0",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "algorithm.ppo_micro_batch_size_per_gpu=4",
    ]
    padded, packed = _padded_and_packed_runs(tmp_path, overrides)
    keys = ("reward", "pg_loss", "grad_norm", "critic/values_mean", "critic/returns_mean", "critic/vf_loss")
    for want, have in zip(padded, packed, strict=True):
        for key in keys:
            assert have[key] == pytest.approx(want[key], abs=1e-5), key
