"""``algorithm.filter_groups`` (DAPO's dynamic sampling): the pure keep-and-join over rollouts, and GRPO runs
whose every step trains on exactly ``data.train_batch_size`` groups with mixed rewards, resume exactly after
drawing extra prompts, and refuse what they do not combine with."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo.settings import FilterGroups
from mcore_rl.config import ConfigError
from mcore_rl.trainer.dynamic_sampling import Sampled, mixed_groups, sample_mixed_groups
from mcore_rl.trainer.trainer import Trainer
from mcore_rl.types import PromptBatch, RolloutBatch, ScoredBatch
from tests.trainer.common import MIXED_REWARD, tiny_run_config

N, PAD = 2, 0
TIMING = ("time/", "tokens_per_s", "memory/")


def _sampled(scores: list[float], width: int, first_prompt: int, errors: int = 0) -> Sampled:
    """Groups of N rows; row r's tokens are all r + 1 (its identity) over ``width`` columns."""
    rows = len(scores)
    tokens = torch.arange(1, rows + 1).unsqueeze(1).expand(rows, width).clone()
    rollout = RolloutBatch(
        tokens=tokens,
        response_mask=torch.ones(rows, width),
        rollout_log_probs=-torch.ones(rows, width),
        response_ids=tokens[:, :2].clone(),
        response_lengths=torch.full((rows,), 2),
        prompt_index=torch.arange(rows // N).repeat_interleave(N),
    )
    groups = rows // N
    prompts = PromptBatch(
        prompt_ids=[[first_prompt + g] for g in range(groups)],
        indices=torch.arange(first_prompt, first_prompt + groups),
        data_sources=["d"] * groups,
        ground_truths=[str(first_prompt + g) for g in range(groups)],
        extra_infos=[{}] * groups,
        origins=[f"row {first_prompt + g}" for g in range(groups)],
    )
    values = torch.tensor(scores)
    return Sampled(rollout, prompts, ScoredBatch(scores=values, rule_scores=values, num_errors=errors))


def test_mixed_groups_are_those_whose_values_differ() -> None:
    assert mixed_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25]), 2) == [1, 3]


def test_kept_groups_of_several_rollouts_join_into_one_batch() -> None:
    first = _sampled([1, 1, 0, 1, 0, 0], width=5, first_prompt=0, errors=1)  # group 1 kept
    later = [_sampled([1, 0, 0, 0, 0, 1], width=7, first_prompt=3, errors=2)]  # groups 0 and 2: one needed
    calls: list[int] = []

    def more() -> Sampled:
        calls.append(1)
        return later.pop(0)

    kept, metrics = sample_mixed_groups(first, more, FilterGroups(enable=True), 2, N, PAD)
    assert len(calls) == 1 and metrics == {
        "filter_groups/num_gen_batches": 2.0,
        "filter_groups/kept_frac": 2 / 6,
    }
    assert kept.rollout.tokens.shape == (4, 7)  # padded to the wider rollout
    assert kept.rollout.tokens[:, 0].tolist() == [3, 4, 1, 2]  # first's rows 2-3, then later's rows 0-1
    assert kept.rollout.tokens[0, 5:].tolist() == [PAD, PAD] and kept.rollout.response_mask[0, 5:].sum() == 0
    assert kept.rollout.prompt_index.tolist() == [0, 0, 1, 1]
    assert kept.prompts.indices.tolist() == [1, 3] and kept.prompts.ground_truths == ["1", "3"]
    assert kept.scored.scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert kept.scored.num_errors == 3  # every rollout's scorer failures, kept or not


def test_the_metric_is_the_reward_the_score_or_the_scorers_acc() -> None:
    sampled = _sampled([1, 1, 0, 1], width=3, first_prompt=0)
    sampled.scored.scores = torch.tensor([1.0, 0.5, 0.0, 0.0])  # e.g. shaped: group 0 mixed, group 1 not
    pick = {
        m: sample_mixed_groups(sampled, lambda: sampled, FilterGroups(True, m, 1), 1, N, PAD)[0]
        for m in ("seq_reward", "score")
    }
    assert pick["seq_reward"].prompts.indices.tolist() == [0] and pick["score"].prompts.indices.tolist() == [
        1
    ]
    sampled.scored.extras = {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0])}  # a dict-returning scorer's acc
    acc, _ = sample_mixed_groups(sampled, lambda: sampled, FilterGroups(True, "acc", 1), 1, N, PAD)
    assert acc.prompts.indices.tolist() == [0]


def test_a_step_short_of_mixed_groups_stops_naming_the_keys() -> None:
    uniform = _sampled([1, 1, 0, 0], width=3, first_prompt=0)
    with pytest.raises(ValueError, match=r"3 rollouts of 2 prompts found only 0 groups.*max_num_gen_batches"):
        sample_mixed_groups(
            uniform, lambda: uniform, FilterGroups(enable=True, max_num_gen_batches=3), 2, N, PAD
        )


def _records(trainer: Trainer) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in trainer.records
        if r["stage"] == "rl" and "reward" in r
    ]


def test_grpo_steps_train_on_mixed_groups_and_resume_exactly(tmp_path) -> None:
    data = str(tmp_path / "data")
    extra = [MIXED_REWARD, "algorithm.filter_groups.enable=true", "trainer.total_training_steps=3"]
    with Trainer.from_config(
        tiny_run_config(data, [*extra, f"trainer.default_local_dir={tmp_path / 'a'}"]), use_ray=False
    ) as straight:
        straight.fit()
        steps = _records(straight)
    assert [s["mixed_groups"] for s in steps] == [1.0, 1.0, 1.0]  # every group trained has signal
    assert max(s["filter_groups/num_gen_batches"] for s in steps) >= 2  # some step drew more prompts
    assert all(s["num_optimizer_steps"] == 1 for s in steps)

    cfg = tiny_run_config(
        data, [*extra, "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path / 'b'}"]
    )
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=2)
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        resumed.fit()
        assert _records(resumed) == steps[2:]  # the loader's position after the extra draws was saved


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae"),
        (["trainer.one_step_off=true"], "trainer.one_step_off=true"),
        (["algorithm.filter_groups.metric=accuracy"], r"algorithm\.filter_groups\.metric='accuracy'"),
    ],
)
def test_what_it_does_not_combine_with_is_refused(tmp_path, extra: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        tiny_run_config(str(tmp_path), ["algorithm.filter_groups.enable=true", *extra])
