"""The reward model: an HF ``LlamaForSequenceClassification`` / ``Qwen2ForSequenceClassification`` (one label,
random weights, saved by ``transformers``) loaded into our value-head megatron model at TP2 scores right-padded
rollouts like ``transformers`` does, within 1e-4 (fp32); a classifier with more labels is refused."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mcore_rl.engine.workers.reward_model import (
    RewardModel,
    RewardModelSpec,
    last_token_values,
    reward_model_arch,
)
from mcore_rl.io.errors import ConfigError
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import RolloutBatch
from tests.models import tiny_hf_config

ROWS, PROMPT, WIDTH, VOCAB = 6, 4, 12, 64


def _save_classifier(
    folder: str, family: str, num_labels: int = 1, vocab: int = VOCAB, positions: int = 64
) -> None:
    import transformers

    hf = tiny_hf_config(family, vocab_size=vocab, max_position_embeddings=positions)
    name = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}[family]
    config = transformers.AutoConfig.for_model(
        hf["model_type"],
        **{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")},
        num_labels=num_labels,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).float()
    with torch.no_grad():  # a visible head (its init std is 0.02 x a tiny body): scores of order 1
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)


def _rollout() -> RolloutBatch:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    mask = torch.zeros(ROWS, WIDTH)
    lengths = torch.tensor([1, 3, 8, 5, 2, 7])
    for row, n in enumerate(lengths.tolist()):
        tokens[row, : PROMPT + n] = torch.randint(1, VOCAB, (PROMPT + n,), generator=generator)
        mask[row, PROMPT - 1 : PROMPT - 1 + n] = 1.0  # position t predicts token t + 1
    zeros = torch.zeros(ROWS, WIDTH)
    return RolloutBatch(tokens, mask, zeros, tokens[:, PROMPT:], lengths, torch.arange(ROWS))


def _scores_at_tp2(folder: str) -> torch.Tensor | None:
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        return RewardModel(ctx, RewardModelSpec(folder)).scores(_rollout(), micro_batch_size=3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_reward_model_scores_equal_transformers(run_distributed, tmp_path, family) -> None:
    import transformers

    folder = str(tmp_path / "rm")
    _save_classifier(folder, family)
    rollout = _rollout()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    with torch.no_grad():
        expected = model(input_ids=rollout.tokens).logits[:, 0]
    got = [s for s in run_distributed(_scores_at_tp2, folder) if s is not None]
    assert len(got) == 1 and got[0].shape == (ROWS,)
    assert (got[0] - expected).abs().max() <= 1e-4
    assert expected.std() > 0.1  # different sequences, different scores: the check has teeth


def test_last_token_values_pick_the_token_after_the_last_mask_position() -> None:
    values = torch.arange(12.0).view(2, 6)
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert last_token_values(values, mask).tolist() == [3.0, 0.0]


def test_a_classifier_with_two_labels_is_refused_naming_the_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {**tiny_hf_config("llama"), "architectures": ["LlamaForSequenceClassification"], "num_labels": 2}
        )
    )
    with pytest.raises(Exception, match=r"config\.json: num_labels=2"):
        reward_model_arch(str(tmp_path))


def test_the_driver_combines_rule_and_model_rewards_with_their_weights(tmp_path) -> None:
    """In-process (the reward model on the actor's rank): the step's reward is 0.5 * rules + 2 * model."""
    import transformers

    from mcore_rl.data.prompts import PromptDataset, PromptLoader
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.scoring import RewardScorer
    from mcore_rl.trainer.build import build_actor_group, worker_spec
    from mcore_rl.trainer.groups.reward_model import RewardModelGroup
    from mcore_rl.trainer.grpo import GRPOStep
    from mcore_rl.types import RolloutRequest
    from tests.trainer.common import MIXED_REWARD, tiny_run_config

    folder = str(tmp_path / "rm")
    _save_classifier(folder, "llama", vocab=14)
    overrides = [
        MIXED_REWARD,
        f"reward_model.path={folder}",
        "reward_model.rule_weight=0.5",
        "reward_model.weight=2",
    ]
    cfg = tiny_run_config(str(tmp_path / "run"), overrides)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    prompts = PromptLoader(
        PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data
    ).next_batch()
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=1), use_ray=False)
    try:
        with RewardScorer(cfg.reward) as scorer:
            reward_model = RewardModelGroup(actors.backend, RewardModelSpec(folder, pad_token_id=0))
            step = GRPOStep(cfg, actors, tokenizer, scorer, reward_model=reward_model)
            rollout = actors.generate(
                RolloutRequest(prompts.prompt_ids, torch.arange(len(prompts))), step.sampling(1)
            )
            scored = step.training_scores(rollout, prompts)
            combined, rules = scored.scores, step.score(rollout, prompts).scores
            assert torch.equal(scored.rule_scores, rules) and scored.model_scores is not None
            metrics = step.run(prompts, 2).metrics()  # a whole step runs with the model reward
    finally:
        actors.shutdown()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    with torch.no_grad():
        model_scores = model(input_ids=rollout.tokens).logits[:, 0]
    assert (combined - (0.5 * rules + 2.0 * model_scores)).abs().max() <= 2e-4
    assert 0 < rules.mean() < 1 and model_scores.std() > 0.1
    assert metrics["num_optimizer_steps"] == 1  # a whole GRPO step trains on the combined reward


def test_the_trainer_converts_an_hf_reward_model_once_and_the_ranks_load_the_checkpoint(tmp_path) -> None:
    """``reward_model.path`` = an HF folder: the driver converts it into ``<run>/reward_model`` (read once),
    the ranks load that checkpoint, and a step runs with the model reward."""
    import os

    from mcore_rl.engine.checkpoint import ModelCheckpointInfo
    from mcore_rl.engine.hf.score_head import has_score_head
    from mcore_rl.trainer.trainer import Trainer
    from tests.trainer.common import MIXED_REWARD, tiny_run_config

    folder = str(tmp_path / "rm")
    _save_classifier(folder, "llama", vocab=14)
    run = tmp_path / "run_dir"
    overrides = [
        MIXED_REWARD,
        f"reward_model.path={folder}",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={run}",
        "logging.progress_bar=false",
        "logging.plot=false",
    ]
    with Trainer.from_config(tiny_run_config(str(tmp_path / "data"), overrides), use_ray=False) as trainer:
        trainer.fit()
        records = [r for r in trainer.records if r["stage"] == "rl"]
    info = ModelCheckpointInfo.read(str(run / "reward_model"))
    assert info is not None and has_score_head(info.arch)
    assert os.path.isfile(run / "reward_model" / "metadata.json")
    assert info.extra["converted_from"] == os.path.abspath(folder)
    assert len(records) == 1 and records[0]["num_optimizer_steps"] == 1


def test_a_reward_model_that_does_not_share_the_policys_tokenizer_is_refused(tmp_path) -> None:
    """The reward model reads the policy's ids as they are: a smaller vocabulary scored ids past it from
    unloaded embedding padding rows (transformers raises on them), another tokenizer read other text."""
    import shutil

    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.trainer.build import check_reward_model_tokens
    from tests.trainer.common import tiny_run_config

    small = str(tmp_path / "small")
    _save_classifier(small, "llama", vocab=10)
    cfg = tiny_run_config(str(tmp_path / "run"), [f"reward_model.path={small}"])
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    with pytest.raises(ConfigError, match=r"reward_model\.path .*vocab_size=10 is smaller than the policy's"):
        check_reward_model_tokens(cfg, tokenizer)

    shared = str(tmp_path / "shared")
    _save_classifier(shared, "llama", vocab=14)
    for name in os.listdir(cfg.model.tokenizer_path):  # the policy's own tokenizer files: accepted
        shutil.copy(os.path.join(cfg.model.tokenizer_path, name), shared)
    check_reward_model_tokens(
        dataclasses.replace(cfg, reward_model=dataclasses.replace(cfg.reward_model, path=shared)), tokenizer
    )

    other = str(tmp_path / "other")
    _save_classifier(other, "llama", vocab=14)
    with open(os.path.join(shared, "tokenizer.json")) as f:
        table = json.load(f)
    vocab = table["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[3:5]  # two ordinary tokens swap ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    for name in os.listdir(shared):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(shared, name), other)
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(table, f)
    with pytest.raises(ConfigError, match=r"reward_model\.path .*its tokenizer .* differs from the policy's"):
        check_reward_model_tokens(
            dataclasses.replace(cfg, reward_model=dataclasses.replace(cfg.reward_model, path=other)),
            tokenizer,
        )

    # the same table written out again (other bytes, other key order): not byte-equal, compared id by id, accepted
    vocab[first], vocab[second] = vocab[second], vocab[first]
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    check_reward_model_tokens(
        dataclasses.replace(cfg, reward_model=dataclasses.replace(cfg.reward_model, path=other)), tokenizer
    )
