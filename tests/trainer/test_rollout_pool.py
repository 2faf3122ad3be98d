"""A rollout pool of its own (``rollout.colocate=false``) beside a 1-rank Ray actor: loaded with the actor's
weights it samples exactly what the actor's colocated engine samples (same prompts, params and seed), before
and after an actor update; a TP2 pool samples what the TP1 pool does; without Ray it is refused."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from mcore_rl.config import ConfigError, RunConfig
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.trainer.build import build_actor_group, build_rollout_group, worker_spec
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.types import RolloutBatch, RolloutRequest, SFTBatch
from tests.trainer.common import tiny_run_config

POOL = ["rollout.colocate=false", "rollout.temperature=1.0"]


@pytest.fixture(scope="module")
def ray_six_cpus() -> Iterator[None]:
    """6 logical CPUs on the 2-core machine: the actor (2) plus a 1-rank pool (3), then a 2-rank pool (2 + 2)
    hold their bundles at once (each rank's share of the cluster, as ``build._cpus_per_rank`` deals it)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from mcore_rl.controller import RayConfig, init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(RayConfig(num_cpus=6, object_store_memory_bytes=128 << 20))
    yield
    ray.shutdown()


def pool_config(folder: str, num_ranks: int, tp: int) -> RunConfig:
    # validated as a pool: rollout TP divides rollout.num_ranks, not the 1-rank actor's world
    return tiny_run_config(
        folder, [*POOL, f"rollout.num_ranks={num_ranks}", f"rollout.tensor_model_parallel_size={tp}"]
    )


@pytest.fixture(scope="module")
def setup(ray_six_cpus: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    folder = str(tmp_path_factory.mktemp("pool"))
    cfg = pool_config(folder, 2, 2)  # the actor's CPU share counts the largest pool of the module
    assert cfg.model.tokenizer_path is not None
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    loader = PromptLoader(PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data)
    prompts = loader.next_batch()
    request = RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts)))
    params = cfg.rollout.sampling_params(tokenizer.eos_token_id, tokenizer.pad_token_id, seed=7)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=4), use_ray=True)
    try:
        yield folder, actors, request, params
    finally:
        actors.shutdown()


def colocated(actors: ActorGroup, request: RolloutRequest, params: SamplingParams) -> RolloutBatch:
    actors.sync_weights()  # the pool's weight gather left the actor in TRAIN
    return actors.generate(request, params)


def assert_same(got: RolloutBatch, want: RolloutBatch, tol: float) -> None:
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.prompt_index, want.prompt_index)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=tol, rtol=0)


def sft_step(actors: ActorGroup, rollout: RolloutBatch) -> None:
    """One supervised step on the rollout's own responses: an update that moves every log-prob."""
    labels = torch.cat([rollout.tokens[:, 1:], rollout.tokens[:, -1:]], dim=1)
    actors.sft_update(SFTBatch(rollout.tokens, labels, rollout.response_mask), micro_batch_size=32)


def test_pool_samples_the_colocated_rollout_before_and_after_an_update(setup: tuple) -> None:
    folder, actors, request, params = setup
    pools = build_rollout_group(pool_config(folder, 1, 1), actors)
    try:
        assert pools.num_rollout_shards == 1
        before = pools.generate(request, params)
        assert before.num_sequences == len(request.prompt_ids) * params.n
        assert_same(before, colocated(actors, request, params), 1e-6)

        sft_step(actors, before)
        pools.load_weights_from(actors)
        wait = pools.submit_generate(request, params)  # submitted behind the load: the new weights
        after = wait()
        assert_same(after, colocated(actors, request, params), 1e-6)
        mask = before.response_mask.bool() & after.response_mask.bool()
        moved = (after.rollout_log_probs - before.rollout_log_probs)[mask].abs().max()
        assert not torch.equal(after.tokens, before.tokens) or moved > 1e-3

        sft_step(actors, after)  # a driver-side copy this time, its load and the generate submitted together
        full = next(s for s in actors.backend.submit("full_state", None, "")() if s is not None)
        load = pools.submit_load_weights(full)
        wait = pools.submit_generate(request, params)
        load()
        assert_same(wait(), colocated(actors, request, params), 1e-6)
        assert pools.phase_memory()["memory/generate_rss_bytes"] > 0
    finally:
        pools.shutdown()


@pytest.mark.sweep  # 22 s of CI: `make test-sweep`
def test_a_tp2_pool_samples_what_the_tp1_pool_samples(setup: tuple) -> None:
    folder, actors, request, params = setup
    tp1 = build_rollout_group(pool_config(folder, 1, 1), actors)
    try:
        want = tp1.generate(request, params)
    finally:
        tp1.shutdown()
    tp2 = build_rollout_group(pool_config(folder, 2, 2), actors)
    try:
        assert tp2.num_rollout_shards == 1
        assert_same(tp2.generate(request, params), want, 1e-5)
    finally:
        tp2.shutdown()


def test_build_refuses_a_pool_without_ray_or_with_colocate(tmp_path) -> None:
    cfg = tiny_run_config(str(tmp_path), POOL)
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=1), use_ray=False)
    try:
        with pytest.raises(ConfigError, match=r"^rollout\.colocate=false: .* needs the Ray driver"):
            build_rollout_group(cfg, actors)
        colocated_cfg = tiny_run_config(str(tmp_path), [])
        with pytest.raises(ConfigError, match=r"^rollout\.colocate=true"):
            build_rollout_group(colocated_cfg, actors)
    finally:
        actors.shutdown()
