"""Sequence classifiers through the conversion tools: the ``score`` head is the value head.

An HF ``LlamaForSequenceClassification`` / ``Qwen2ForSequenceClassification`` (one label, random weights,
saved by transformers) converts to a megatron checkpoint written by two ranks at TP2, back to HF bit-exact
(tensors and config.json); the reward model loads the converted checkpoint at TP2 and at PP2 (each rank
reading its own shards) and scores rollouts like transformers within 1e-4 (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore
from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf
from mcore_rl.engine.checkpoint import ModelCheckpointInfo
from mcore_rl.engine.hf.score_head import arch_of_config, has_score_head, hf_config_of
from mcore_rl.engine.workers.reward_model import RewardModel, RewardModelSpec, reward_model_arch
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.convert.hf_models import listing
from tests.convert.test_hf_parity import _all_tensors
from tests.engine.workers.test_reward_model import ROWS, _rollout, _save_classifier

LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}


def _convert_back_and_score(hf_dir: str, ckpt: str, out: str) -> dict[str, torch.Tensor]:
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, ckpt, tp=2))
    convert_mcore_to_hf(McoreToHfOptions(ckpt, out))  # rank 0 only
    scores = {}
    for name, parallel in LAYOUTS.items():
        with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
            got = RewardModel(ctx, RewardModelSpec(ckpt)).scores(_rollout(), micro_batch_size=3)
            if got is not None:
                scores[name] = got
    return scores


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_classifier_round_trip_is_bit_exact_and_scores_equal_transformers(run_distributed, tmp_path, family):
    import transformers

    hf_dir, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), tmp_path / "back"
    _save_classifier(hf_dir, family)
    results = run_distributed(_convert_back_and_score, hf_dir, ckpt, str(out))

    before, after = _all_tensors(hf_dir), _all_tensors(str(out))
    assert "score.weight" in before and sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == original

    info = ModelCheckpointInfo.read(ckpt)
    assert info is not None and has_score_head(info.arch) and "metadata.json" in listing(ckpt)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).float().eval()
    with torch.no_grad():
        expected = model(input_ids=_rollout().tokens).logits[:, 0]
    merged = {name: s for per_rank in results for name, s in per_rank.items()}
    assert sorted(merged) == sorted(LAYOUTS)
    for name, scores in merged.items():
        assert scores.shape == (ROWS,) and (scores - expected).abs().max() <= 1e-4, name
    assert expected.std() > 0.1  # different rows, different scores: the check has teeth


def test_body_config_restores_the_classifier_config() -> None:
    from tests.models import tiny_hf_config

    cfg = {**tiny_hf_config("qwen2"), "architectures": ["Qwen2ForSequenceClassification"]}
    cfg["tie_word_embeddings"] = True
    arch = arch_of_config(cfg, "config.json")
    assert has_score_head(arch) and not arch.tie_word_embeddings  # a classifier has no LM head to tie
    assert hf_config_of(arch.extra) == cfg
    causal = arch_of_config(tiny_hf_config("llama"), "config.json")
    assert not has_score_head(causal) and hf_config_of(causal.extra) == tiny_hf_config("llama")


def test_a_causal_lm_checkpoint_is_refused_as_a_reward_model(tmp_path) -> None:
    from tests.models import tiny_hf_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    with pytest.raises(Exception, match=r"config\.json: architectures=\['LlamaForCausalLM'\]"):
        reward_model_arch(str(tmp_path))
