"""``model.recompute``: megatron's selective and full activation recomputation give the step that keeping every
activation gives (the key reached no run before: the planner proposed layouts that needed it)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.weights import gather_full_state, load_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import LabeledMicroBatch, tiny_arch


def _step(recompute: str, start: dict | None) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    arch = tiny_arch("llama")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, arch.vocab_size, (2, 12), generator=gen)
    batch = LabeledMicroBatch(tokens, torch.arange(12).expand_as(tokens), labels=torch.roll(tokens, -1, 1))
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(
            arch, ctx, ModelOptions(recompute=recompute), OptimConfig(weight_decay=0.0)
        )
        if start is None:
            start = gather_full_state(engine.models, arch, ctx)
        load_full_state(engine.models, start, arch, ctx)
        assert engine.config.recompute_granularity == (None if recompute == "none" else recompute)

        def loss_fn(output, mb):
            loss = vocab_parallel_cross_entropy(
                output.float().transpose(0, 1).contiguous(), mb.labels.t().contiguous()
            )
            return loss.mean(), {"loss": loss.mean().detach().clone()}

        result, records = engine.train_step([batch], loss_fn)
        return {
            "start": start,
            "loss": float(records[0]["loss"]),
            "grad_norm": result.grad_norm,
            "after": gather_full_state(engine.models, arch, ctx),
        }


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_step(run_distributed, recompute: str) -> None:
    kept = run_distributed(_step, "none", None, world_size=1)[0]
    again = run_distributed(_step, recompute, kept["start"], world_size=1)[0]
    assert again["loss"] == pytest.approx(kept["loss"], rel=1e-6)
    assert again["grad_norm"] == pytest.approx(kept["grad_norm"], rel=1e-5)
    for name, weight in kept["after"].items():
        torch.testing.assert_close(again["after"][name], weight, rtol=1e-5, atol=1e-6)


def test_the_run_config_reaches_the_engines_and_the_planner(tmp_path) -> None:
    from mcore_rl.planner.from_config import plan_input_from_config
    from mcore_rl.trainer.build import critic_spec, worker_spec
    from tests.trainer.common import tiny_run_config

    cfg = tiny_run_config(str(tmp_path), ["model.recompute=full", "algorithm.adv_estimator=gae"])
    assert worker_spec(cfg, 1).recompute == "full" and critic_spec(cfg, 1).recompute == "full"
    assert plan_input_from_config(cfg, gpu="H100-80").recompute == "full"
