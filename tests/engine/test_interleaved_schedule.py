"""megatron's interleaved (virtual pipeline) schedule at PP2 with micro-batches of different lengths: the two
stages' shape exchange crossed the activation's and the gradient's shapes (``compat/pipeline_shapes.py``), and
with no more micro-batches than stages (all of them warm-up ones) the schedule deadlocked; the engine's fillers
make up the count. The step equals the same step on one process."""

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


def _micro_batches(vocab: int, count: int) -> list[LabeledMicroBatch]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        tokens = torch.randint(1, vocab, (2, 6 + 4 * i), generator=gen)  # lengths differ: variable shapes
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        out.append(LabeledMicroBatch(tokens, positions, labels=torch.roll(tokens, -1, 1)))
    return out


def _step(parallel: dict, count: int, start: dict | None) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(), OptimConfig(weight_decay=0.0))
        if start is None:
            start = gather_full_state(engine.models, arch, ctx)
        load_full_state(engine.models, start, arch, ctx)

        def loss_fn(output, mb):
            loss = vocab_parallel_cross_entropy(
                output.float().transpose(0, 1).contiguous(), mb.labels.t().contiguous()
            ).sum()
            return loss, {"loss": loss.detach().clone()}

        result, records = engine.train_step(_micro_batches(arch.vocab_size, count), loss_fn)
        return {
            "start": start,
            "grad_norm": result.grad_norm,
            "losses": [float(r["loss"]) for r in records],
            "after": gather_full_state(engine.models, arch, ctx),
        }


@pytest.mark.parametrize("count", [1, 2, 3, 4])  # 4: no fillers, the shapes alone
def test_as_many_micro_batches_as_stages_train_as_on_one_process(run_distributed, count: int) -> None:
    one = run_distributed(_step, {}, count, None, world_size=1, timeout_s=300)[0]
    interleaved = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    ranks = run_distributed(_step, interleaved, count, one["start"], world_size=2, timeout_s=120)
    last = ranks[1]  # the last stage holds the losses
    assert len(last["losses"]) == count  # the fillers leave no record
    assert last["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert last["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name, weight in one["after"].items():
        torch.testing.assert_close(last["after"][name], weight, rtol=1e-5, atol=1e-6)
