"""3D-HybridEngine end to end: train layouts TP2xPP2 and TP2xDP2 (4 ranks) -> rollout TP1 / TP2.

The rollout engine's per-token log-probs on its own samples must equal the actor's recomputed log-probs
(fp32, 1e-5), so the first PPO ratio is exactly 1; and after a training step and a second switch, the
rollout engine must follow the updated actor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.model import build_model_chunks
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.train_engine import MicroBatch, OptimizerConfig, TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.ops import vocab_parallel_logprob_entropy
from mcore_rl.parallel.context import ParallelConfig, ParallelContext
from mcore_rl.parallel.reshard.hybrid import HybridConfig, Phase
from tests.models import tiny_arch

TEMPERATURE = 0.9
PROMPTS = [[5, 17, 33], [9, 2, 41, 77, 3], [120], [64, 65, 66, 67]]


def _actor_log_probs(engine: TrainEngine, ctx: ParallelContext, out, vocab_size: int) -> torch.Tensor | None:
    """Recompute log p(response token) with the actor; [N, max_new] on the last stage, None elsewhere."""
    sequences = [PROMPTS[int(i)] + r for i, r in zip(out.prompt_index, out.responses(), strict=True)]
    length = max(len(s) for s in sequences)
    length += length % ctx.tp_size  # sequence parallelism would need divisibility; keep shapes even
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(seq)
    positions = torch.arange(length).expand_as(tokens)

    def loss_fn(logits, mb):
        shard = logits.shape[-1]
        targets = torch.roll(mb.tokens, -1, 1).clamp(max=vocab_size - 1)
        logp, _ = vocab_parallel_logprob_entropy(
            logits.float().reshape(-1, shard),
            targets.reshape(-1),
            vocab_start=ctx.tp_rank * shard,
            vocab_size=vocab_size,
            temperature=TEMPERATURE,
            tp_group=ctx.tp_group if ctx.tp_size > 1 else None,
        )
        return logits.sum() * 0, {"logp": logp.reshape(mb.tokens.shape).detach()}

    result = engine.forward_backward([MicroBatch(tokens, positions)], loss_fn, forward_only=True)
    if not result:
        return None
    full = result[0]["logp"]
    actor = torch.zeros_like(out.log_probs)
    for row, (index, n) in enumerate(zip(out.prompt_index.tolist(), out.lengths.tolist(), strict=True)):
        start = len(PROMPTS[index]) - 1  # logits at position t predict token t+1
        actor[row, :n] = full[row, start : start + n]
    return actor


def _hybrid_parity(family: str, parallel: dict, tp_g: int) -> dict:
    arch = tiny_arch(family)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimizerConfig(lr=1e-2))
        engine.load_full_state(full)
        hybrid, rollout = build_local_hybrid(engine, tp_g, HybridConfig(bucket_bytes=16 << 10))
        diffs = []
        for step in range(2):
            transition = hybrid.to_rollout()
            assert not rollout.missing_weights()
            params = SamplingParams(temperature=TEMPERATURE, n=2, max_new_tokens=6, seed=100 + step)
            out = rollout.generate(PROMPTS, params)
            hybrid.to_train()
            actor = _actor_log_probs(engine, ctx, out, arch.vocab_size)
            if actor is not None:
                mask = out.response_mask()
                diffs.append(float((actor - out.log_probs)[mask].abs().max()))
            # One real update between the two switches: the second rollout must see the new weights.
            batch = MicroBatch(torch.tensor([PROMPTS[1] * 2]), torch.arange(10)[None])
            engine.train_step([batch], lambda o, mb: (o.float().logsumexp(-1).mean(), {}))
        return {
            "diffs": diffs,
            "phase": hybrid.phase,
            "received": transition.reshard.bytes_received,
            "planned": hybrid.plan.received_bytes()[dist.get_rank()],
            "history": len(hybrid.history),
        }


@pytest.mark.parametrize("tp_g", [1, 2])
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
    ids=["tp2-pp2", "tp2-dp2"],
)
def test_rollout_log_probs_equal_actor_log_probs(run_distributed, parallel, tp_g):
    results = run_distributed(_hybrid_parity, "llama", parallel, tp_g, world_size=4)
    last_stage = [r for r in results if r["diffs"]]
    assert last_stage
    for result in results:
        assert result["phase"] is Phase.TRAIN and result["history"] == 4
        assert result["received"] == result["planned"]
    worst = max(max(r["diffs"]) for r in last_stage)
    assert worst <= 1e-5, f"max |rollout - actor| log-prob difference {worst:.3g}"
