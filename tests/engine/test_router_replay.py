"""Routing agreement and router replay on a mixture-of-experts actor at EP2 (world 2, rollout TP1 per rank).

The rollout engine records the experts it routed each token to; the trainer's routers compare their own top-k
with them (the standing metric) and, with replay on, use the rollout's experts instead. Unperturbed, the two
route alike (agreement 1, log-probs within 1e-5). A perturbed rollout, whose router picks its experts from
noised logits but weighs them with the true ones (as bf16 near-ties flip a choice), routes differently: the
trainer's log-probs then disagree, unless it replays the rollout's choices, when they agree by construction.
"""

from __future__ import annotations

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.micro_batches import positions
from mcore_rl.engine.rollout import moe as rollout_moe
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.rollout.batch import rollout_batch
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.workers.losses import LogProbMicroBatch, log_prob_loss
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.parallel.test_hybrid_moe import MOE, _full_state

PROMPTS = [[5, 17, 33], [9, 2, 41, 77, 3], [120, 7], [64, 65, 66, 67]]
PARAMS = SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=11)


def _perturbed_route(hidden, router_weight, top_k, norm_topk_prob):
    """Experts chosen from noised logits, weighed with the true ones (the rollout side of a near-tie flip)."""
    logits = torch.mm(hidden.float(), router_weight.float().t())
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(hidden.shape[0])) * 1.5
    experts = torch.topk(logits + noise, k=top_k, dim=1).indices
    return rollout_moe.probs_of(hidden, router_weight, experts, norm_topk_prob), experts


def _trainer_log_probs(engine: TrainEngine, batch, replay: bool) -> tuple[torch.Tensor, float | None]:
    routing = engine.routing
    assert routing is not None
    routing.set_replay(replay)
    routing.counts.active = True
    micro = [
        LogProbMicroBatch(
            batch.tokens,
            positions(batch.tokens),
            expert_choices=batch.expert_choices,
            mask=batch.response_mask,
        )
    ]
    out = engine.forward_backward(
        micro, log_prob_loss(engine.arch.vocab_size, PARAMS.temperature), forward_only=True
    )
    routing.counts.active = False
    return out[0].log_probs, routing.take_agreement()


def _replay_runs(perturb: bool) -> dict:
    arch = ModelArch.from_hf_config(MOE)
    with ParallelContext.initialize(ParallelConfig(expert_model_parallel_size=2)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0))
        engine.load_full_state(_full_state(arch, seed=7))
        engine.watch_routing()
        hybrid, rollout = build_local_hybrid(engine, 1)
        hybrid.to_rollout()
        original = rollout_moe.route
        if perturb:
            rollout_moe.route = _perturbed_route
        try:
            out = rollout.generate(PROMPTS, PARAMS)
        finally:
            rollout_moe.route = original
        hybrid.to_train()
        batch = rollout_batch(PROMPTS, torch.arange(len(PROMPTS)), out, pad_id=0)
        mask = batch.response_mask.bool()
        result: dict = {"recorded": float((batch.expert_choices >= 0).float().mean())}
        for replay in (False, True):
            log_probs, agreement = _trainer_log_probs(engine, batch, replay)
            result[replay] = {
                "gap": float((log_probs - batch.rollout_log_probs)[mask].abs().max()),
                "agreement": agreement,
            }
        return result


def _both_runs() -> tuple[dict, dict]:
    return _replay_runs(False), _replay_runs(True)


def test_router_replay_agreement_and_a_perturbed_rollout(run_distributed):
    for unperturbed, perturbed in run_distributed(_both_runs):
        assert unperturbed["recorded"] > 0.7  # prompt and response tokens carry the rollout's choices
        for replay in (False, True):  # the rollout routes as the trainer does
            assert unperturbed[replay]["agreement"] == 1.0
            assert unperturbed[replay]["gap"] < 1e-5, unperturbed
        own, replayed = perturbed[False], perturbed[True]
        assert own["agreement"] < 0.9  # the trainer's own choices differ from the rollout's
        assert own["gap"] > 1e-2  # and so do its log-probs
        assert replayed["gap"] < 1e-5, perturbed  # the rollout's experts replayed: equal by construction
        assert replayed["agreement"] == own["agreement"]  # measured on the trainer's own choice either way


def test_routing_follows_shared_prompt_packing() -> None:
    """model.share_prompt_prefix packs a group's prompt once: each packed token's rollout routing is its first
    reader's row position, filler has none (-1). Read as plain packing's index, the rows were misaligned
    (TP1: a shape error; with sequence-parallel filler, another row's experts)."""
    from types import SimpleNamespace

    from mcore_rl.engine.moe import _model_order
    from mcore_rl.engine.packing.micro_batches import packed
    from mcore_rl.engine.train_engine import MicroBatch

    tokens = torch.tensor([[5, 6, 7, 0], [5, 8, 9, 0]])  # one prompt [5], two responses of two tokens
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    choices = (100 * torch.arange(2)[:, None] + torch.arange(4)[None]).reshape(2, 4, 1, 1)  # row * 100 + col
    ctx = SimpleNamespace(layout=SimpleNamespace(sp=False), tp_size=1, tp_rank=0, device=torch.device("cpu"))
    for multiple, expected in ((1, [0, 1, 2, 101, 102]), (2, [0, 1, 2, 101, 102, -1])):
        micro = packed(
            MicroBatch(tokens, positions(tokens)),
            mask,
            multiple,
            0,
            remove_padding=True,
            share_prompt_prefix=True,
        )
        assert micro.packed.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
        assert _model_order(choices, micro, ctx)[:, 0, 0].tolist() == expected
