"""The in-process RL step on a CUDA device (NCCL world of one rank), fp32: hybrid engine reshard -> embedded
rollout engine -> trainer forward through the fused LM-head log-prob op (padded and packed rows) -> policy update -> reshard again.

The bar of the CPU suite, on the GPU: the rollout engine's log-probs equal the trainer's within 1e-5 before
and after an update, the update is finite and moves the weights. Runs only where CUDA is (``gpu`` marker).
For the mixture-of-experts model (Qwen3-MoE) it is megatron's own CUDA all-to-all dispatcher and router on
the trainer's side (the CPU shims are off), with router weights scaled up so no fp32 rounding flips a choice.
With LoRA adapters, the rollout gets the merged weights (merged on the device) and the update moves only
the adapters.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo.agreement import prob_agreement
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.lora_spec import LoRASpec, resolve_targets
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.token_batching import packing_of
from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.engine.rollout.batch import rollout_batch
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.workers.losses import (
    LogProbMicroBatch,
    PolicyLossSettings,
    PolicyMicroBatch,
    log_prob_loss,
    policy_loss,
)
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import RolloutBatch, TrainBatch
from tests.models import tiny_arch


def _rollout(hybrid, engine, prompts: list[list[int]], seed: int) -> RolloutBatch:  # type: ignore[no-untyped-def]
    hybrid.to_rollout()
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=8, seed=seed)
    out = hybrid.generate(prompts, params)
    hybrid.to_train()
    return rollout_batch(prompts, torch.arange(len(prompts)), out, pad_id=0)


def _trainer_log_probs(
    engine: TrainEngine, batch: RolloutBatch, vocab: int, packed: bool = False
) -> torch.Tensor:
    positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
    micro = LogProbMicroBatch(batch.tokens, positions, mask=batch.response_mask)
    if packed:  # model.use_remove_padding: rows end to end, PackedSeqParams moved to the device with them
        micro.packed = packing_of(batch.response_mask).model_input(batch.tokens, 0)
    out = engine.forward_backward([micro], log_prob_loss(vocab, 1.0), forward_only=True)
    return out[0].log_probs.float().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "llama+lora", "qwen3+yarn"])
def test_rl_step_on_cuda_keeps_rollout_and_trainer_log_probs_equal(family: str) -> None:
    """``qwen3+yarn``: YaRN's attention factor reaches TE's attention as megatron's softmax_scale and the
    embedded engine's scale alike, and its step trains with GSPO's loss."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the 1e-5 bar
    family, _, variant = family.partition("+")
    adapters, yarn = variant == "lora", variant == "yarn"
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    arch = tiny_arch(family, **({"rope_parameters": rope} if yarn else {}))
    lora = LoRASpec(
        rank=4, alpha=8.0, targets=resolve_targets(["q_proj", "o_proj", "gate_proj", "down_proj"])
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, arch.vocab_size, (4, 6), generator=gen).tolist()
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        assert ctx.device.type == "cuda"
        engine = TrainEngine.build(
            arch,
            ctx,
            ModelOptions(dtype=torch.float32, lora=lora if adapters else None),
            OptimConfig(weight_decay=0.0, lr=1e-2),
        )
        with torch.no_grad():  # decisive MoE routing (no near-ties for rounding to flip)
            for name, param in engine.models[0].named_parameters():
                if name.endswith("router.weight"):
                    param.mul_(20.0)
        hybrid, rollout = build_local_hybrid(engine)
        assert rollout.device.type == "cuda"  # the embedded engine samples on the training ranks' device
        before = {n: p.detach().clone() for n, p in engine.models[0].named_parameters()}
        for step in range(2):
            batch = _rollout(hybrid, engine, prompts, seed=step)
            trainer = _trainer_log_probs(engine, batch, arch.vocab_size)
            agreement = prob_agreement(batch.rollout_log_probs, trainer, batch.response_mask)
            assert agreement.token_mult_prob_error == pytest.approx(1.0, abs=1e-5), step
            packed = _trainer_log_probs(engine, batch, arch.vocab_size, packed=True)
            assert (packed - trainer).abs().max() <= 1e-5, step
            mask = batch.response_mask
            advantages = torch.randn(mask.shape[0], 1, generator=gen) * mask
            train = TrainBatch(batch.tokens, mask, trainer, advantages, torch.zeros_like(mask))
            positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
            settings = PolicyLossSettings(
                vocab_size=arch.vocab_size, temperature=1.0, loss_mode="gspo" if yarn else "vanilla"
            )
            loss = policy_loss(settings, mask.sum(), torch.tensor(float(mask.shape[0])))
            engine.zero_grad()
            metrics = engine.forward_backward([PolicyMicroBatch(batch.tokens, positions, train=train)], loss)
            result = engine.step()
            assert result.update_successful and torch.isfinite(torch.tensor(result.grad_norm))
            assert torch.isfinite(metrics[0].pg_loss.float().cpu())
        moved = [n for n, p in engine.models[0].named_parameters() if not torch.equal(p.detach(), before[n])]
        assert moved, "the updates changed no weight"
        if adapters:  # the base stays frozen
            assert all("lora" in n for n in moved), moved
