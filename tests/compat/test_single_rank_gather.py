"""The skipped parameter gather of a one-rank distributed-optimizer group (``compat.megatron_cpu``).

megatron's gather after each optimizer step is a self-copy there; on gloo it ran on the process group's worker
thread and left every later small 2-thread GEMM of the process twice as slow (issue 17). Without it the step
updates the weights exactly as the non-distributed optimizer does, and no gather is issued.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch


def _weights_after_two_steps(distributed: bool) -> dict[str, torch.Tensor]:
    arch = tiny_arch("llama")
    tokens = torch.randint(0, arch.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = MicroBatch(tokens, torch.arange(12).expand(4, 12))
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        optim = OptimConfig(weight_decay=0.0, lr=1e-3, use_distributed_optimizer=distributed)
        engine = TrainEngine.build(arch, ctx, optim=optim)
        for _ in range(2):
            engine.train_step([batch], lambda out, mb: (out.float().square().mean(), {}))
        return {n: p.detach().clone() for n, p in engine.models[0].named_parameters()}


def test_a_one_rank_distributed_optimizer_updates_like_the_plain_one_without_a_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.distributed import param_and_grad_buffer

    gathers = []
    original = param_and_grad_buffer.dist_all_gather_func
    monkeypatch.setattr(
        param_and_grad_buffer,
        "dist_all_gather_func",
        lambda *args, **kwargs: gathers.append(1) or original(*args, **kwargs),
    )
    distributed = _weights_after_two_steps(distributed=True)
    assert not gathers
    plain = _weights_after_two_steps(distributed=False)
    assert distributed.keys() == plain.keys()
    for name, weight in plain.items():
        torch.testing.assert_close(distributed[name], weight, rtol=0, atol=1e-6, msg=name)
