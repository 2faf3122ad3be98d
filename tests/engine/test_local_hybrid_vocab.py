"""The embedded hybrid engine of a trainer whose vocab padding is not megatron's default 128
(``ModelOptions.make_vocab_size_divisible_by``): its plan assumed 128, and the first sync failed on the
embedding's shape."""

from __future__ import annotations

import torch

from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch


def test_the_sync_follows_the_trainers_vocab_padding() -> None:
    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        options = ModelOptions(make_vocab_size_divisible_by=100)
        engine = TrainEngine.build(arch, ctx, options, OptimConfig(weight_decay=0.0))
        hybrid, rollout = build_local_hybrid(engine)
        hybrid.to_rollout()
        full = gather_full_state(engine.models, arch, ctx)
        synced = rollout.decoder.weights["embed_tokens.weight"]
        assert torch.equal(synced[: arch.vocab_size], full["embedding.word_embeddings.weight"])
