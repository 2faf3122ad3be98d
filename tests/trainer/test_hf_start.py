"""A run that starts from an HF safetensors folder (``model.path``): the actor's log-probs of sampled
responses equal transformers' on the same folder (Llama, and Qwen3 with its q/k norms)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.trainer.build import build_actor_group, worker_spec
from mcore_rl.types import RolloutRequest
from tests.convert.hf_models import hf_logits, save_hf_model
from tests.trainer.common import tiny_run_config


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_actor_starts_from_the_hf_weights(tmp_path, family: str) -> None:
    hf_dir = save_hf_model(str(tmp_path / "hf"), family, vocab_size=14, max_position_embeddings=32)
    cfg = tiny_run_config(str(tmp_path / "data"), [f"model.path={hf_dir}"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_config={}))  # the folder's config
    assert cfg.model.arch().family == family
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=1), use_ray=False)
    try:
        params = cfg.rollout.sampling_params(eos_token_id=1, pad_token_id=0, seed=3)
        rollout = actors.generate(RolloutRequest([[5, 6, 7, 8], [9, 10]], torch.arange(2)), params)
        ours = actors.submit_log_probs(rollout, temperature=1.0, micro_batch_size=8)()
    finally:
        actors.shutdown()
    logits = hf_logits(hf_dir, rollout.tokens)
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.roll(rollout.tokens, -1, 1)[..., None])[..., 0]
    mask = rollout.response_mask > 0
    assert mask.sum() > 4
    assert torch.allclose(ours.actor_log_probs[mask], theirs[mask], atol=1e-4)
    assert torch.allclose(rollout.rollout_log_probs[mask], theirs[mask], atol=1e-4)
