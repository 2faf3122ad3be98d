"""Failure propagation on 4 gloo ranks (TP2 x PP2, rollout TP2): one rank fails for real inside a hybrid
transition, a rollout step or a train step; every rank must stop within seconds (not the 30-minute collective
timeout) and every peer's error must name the failing rank, its exception and where it happened. Afterwards
the world is rejoined, so the shared test pool keeps working."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mcore_rl.compat.grad_reduce import REDUCER_ATTR
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.failure import FailureGuard, FailureReport, PeerFailureError, rejoin_world
from tests.models import tiny_arch
from tests.parallel.test_hybrid_parity import PROMPTS

FAIL_RANK = 3
BOUND_S = 20.0
"""Seconds within which every rank must have stopped; one poll of the watchdog is 0.5 s."""


def _fail_here(where: str, point: str) -> bool:
    return where == point and dist.get_rank() == FAIL_RANK


def _one_rl_step(where: str) -> float:
    """to_rollout -> generate -> to_train -> train_step with a real error at ``where`` on FAIL_RANK; returns
    the time the failure point was reached (every rank starts it at about the same time)."""
    arch = tiny_arch("qwen2", num_hidden_layers=2)  # tied embeddings under PP2
    with ParallelContext.initialize(
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    ) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-3))
        hybrid, _ = build_local_hybrid(engine, tp_g=2)
        if _fail_here(where, "reshard"):  # a training shard of the wrong shape: the executor refuses it
            good = hybrid.local_params
            hybrid.local_params = lambda: {k: v[:1] if v.dim() == 2 else v for k, v in good().items()}
        dist.barrier()
        started = time.time()
        hybrid.to_rollout()
        # A token id past the vocabulary: the rollout engine refuses the prompt before its first collective.
        prompts = [[arch.vocab_size + 7]] if _fail_here(where, "rollout") else PROMPTS
        hybrid.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
        hybrid.to_train()

        def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
            if _fail_here(where, "train_step"):
                raise ZeroDivisionError("injected in the loss of the last stage")
            return logits.float().logsumexp(-1).mean(), {}

        batch = MicroBatch(torch.tensor([PROMPTS[1] * 2]), torch.arange(10)[None])
        engine.train_step([batch, batch], loss_fn)
    return started


def _inject(where: str) -> dict:
    outcome: dict = {"error": None}
    started = time.time()
    try:
        started = _one_rl_step(where)
    except Exception as err:
        outcome["error"] = (type(err).__name__, str(err))
    outcome["stopped_after_s"] = time.time() - started
    rejoin_world()  # every connection of the old world is severed; the pool's next test needs a fresh one
    return outcome


def _world_still_works() -> float:
    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value)


@pytest.mark.parametrize(
    ("where", "error"),
    [("reshard", "ValueError"), ("rollout", "ValueError"), ("train_step", "ZeroDivisionError")],
)
def test_one_failing_rank_stops_every_peer_with_its_name(run_distributed, where, error):
    outcomes = run_distributed(_inject, where, world_size=4, timeout_s=240)
    own = outcomes[FAIL_RANK]["error"]
    assert own is not None and own[0] == error, own
    for rank, outcome in enumerate(outcomes):
        assert outcome["stopped_after_s"] < BOUND_S, (rank, outcome)
        if rank != FAIL_RANK:
            kind, message = outcome["error"]
            assert kind == "PeerFailureError", (rank, outcome)
            assert f"rank {FAIL_RANK} failed during" in message and error in message, (rank, message)
    assert run_distributed(_world_still_works, world_size=4) == [4.0] * 4


def _fails_before_the_gradient_sum() -> dict:
    """Two data-parallel ranks (their gradients summed through host memory): rank 1 raises in its loss while
    rank 0 goes on to the gradient sum and waits there for it."""
    outcome: dict = {"error": None, "host_reduce": False}
    started = time.time()
    try:
        with ParallelContext.initialize(ParallelConfig()) as ctx:
            # the run's default on CPU: gradients all-reduced, through host memory
            optim = OptimConfig(lr=1e-3, use_distributed_optimizer=None)
            engine = TrainEngine.build(tiny_arch("llama", num_hidden_layers=1), ctx, optim=optim)
            outcome["host_reduce"] = all(
                getattr(group, REDUCER_ATTR, None) is not None
                for chunk in engine.chunks
                for group in chunk.bucket_groups
            )

            def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
                if dist.get_rank() == 1:
                    raise ZeroDivisionError("injected in rank 1's loss")
                return logits.float().logsumexp(-1).mean(), {}

            dist.barrier()
            started = time.time()
            engine.train_step([MicroBatch(torch.tensor([PROMPTS[1] * 2]), torch.arange(10)[None])], loss_fn)
    except Exception as err:
        outcome["error"] = (type(err).__name__, str(err))
    outcome["stopped_after_s"] = time.time() - started
    rejoin_world()
    return outcome


def test_a_rank_failing_before_the_host_gradient_sum_stops_the_peer_waiting_there(run_distributed):
    """No gloo connection is involved in the wait, so severing alone would leave rank 0 there for the
    collective timeout (30 minutes): the mapping's abort word stops it."""
    waiting, failed = run_distributed(_fails_before_the_gradient_sum, timeout_s=120)
    assert waiting["host_reduce"], "the engine's gradients did not go through host memory"
    assert failed["error"][0] == "ZeroDivisionError", failed
    kind, message = waiting["error"]
    assert kind == "PeerFailureError" and "rank 1 failed during forward_backward" in message, waiting
    assert "ZeroDivisionError" in message, message
    assert waiting["stopped_after_s"] < BOUND_S and failed["stopped_after_s"] < BOUND_S
    assert run_distributed(_world_still_works) == [2.0, 2.0]


def test_failure_report_round_trips_and_names_the_rank():
    report = FailureReport(2, "reshard", "KeyError: 'a\nb'")
    assert FailureReport.decode(report.encode().encode()) == report
    assert str(PeerFailureError(report, 0, "rollout")).startswith("rank 2 failed during reshard: KeyError")


def test_watchdog_learns_the_first_failure_and_the_next_guard_names_it():
    store = dist.HashStore()
    first, second = (
        FailureGuard(store, "k", rank=0, poll_s=0.05),
        FailureGuard(store, "k", rank=1, poll_s=0.05),
    )
    try:
        with pytest.raises(RuntimeError, match="boom"), first.guard("reshard"):
            raise RuntimeError("boom")
        deadline = time.time() + 5
        while second.failure is None and time.time() < deadline:  # only the watchdog can set it here
            time.sleep(0.01)
        assert second.failure is not None and second.failure.rank == 0
        assert second.post(FailureReport(1, "rollout", "late")).rank == 0  # the first post wins
        match = "rank 0 failed during reshard: RuntimeError: boom"
        with pytest.raises(PeerFailureError, match=match), second.guard("train_step"):
            pass
    finally:
        first.close()
        second.close()
