"""``data.drop_last=false``: the epoch's last, shorter batch is a step of its own where it splits over the ranks
and micro-batches as a full batch does, and is refused before anything starts where it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.config.batch_rules import last_batch_problem
from tests.trainer.common import QUIET, rl_records, tiny_run_config

# tiny_run_config's data: 64 training prompts, 4 samples each, one rank
SHORT = ["data.drop_last=false", "data.train_batch_size=12"]  # 5 batches of 12, then one of 4


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["data.drop_last=true", "data.train_batch_size=12"], False),  # the 4 are dropped
        (["data.drop_last=false", "data.train_batch_size=16"], False),  # 64 = 4 x 16: no last batch
        (SHORT, False),  # 16 sequences, one mini-batch, micro-batches of 8
        ([*SHORT, "algorithm.ppo_micro_batch_size_per_gpu=6"], True),  # a full batch's 48 split by 6, not 16
        ([*SHORT, "algorithm.ppo_mini_batch_size=4"], True),  # 3 mini-batches of the 16 sequences
        ([*SHORT, "algorithm.ppo_mini_batch_size=6"], False),  # 2 mini-batches of 8 sequences
        ([*SHORT, "algorithm.ppo_mini_batch_size=6", "algorithm.ppo_micro_batch_size_per_gpu=12"], True),
        # PPO: the critic splits the 16 sequences with its own micro-batches (12 divides a full batch's 48)
        ([*SHORT, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=12"], True),
        ([*SHORT, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=16"], False),
    ],
)
def test_a_short_last_batch_is_kept_only_where_it_splits_as_a_full_one_does(
    tmp_path: Path, overrides: list[str], refused: bool
) -> None:
    cfg = tiny_run_config(str(tmp_path), overrides)
    problem = last_batch_problem(cfg, 64)
    assert (problem is not None) == refused
    if refused:
        assert problem is not None and problem.startswith("data.drop_last=false: the 64 training prompts")
        assert "last batch of 4" in problem


def test_the_last_batch_of_an_epoch_trains_as_a_step_of_its_own(tmp_path: Path) -> None:
    positions: list[tuple[int, int]] = []

    def where(trainer) -> None:
        sampler = trainer.data.loader.sampler
        positions.append((sampler.epoch, sampler.position))

    overrides = [*QUIET, *SHORT, "trainer.total_epochs=1"]
    steps = rl_records(str(tmp_path / "data"), tmp_path / "run", overrides, where)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # drop_last=true would stop after 5
    assert positions == [(0, 64)]  # the sixth step drew the last 4 prompts of the epoch
    assert all(r["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5) for r in steps)


def test_a_last_batch_that_cannot_split_is_refused_before_the_run_folder_is_made(tmp_path: Path) -> None:
    from mcore_rl.trainer.trainer import Trainer

    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [*SHORT, "algorithm.ppo_mini_batch_size=4", f"trainer.default_local_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(ConfigError, match=r"^data\.drop_last=false: .* last batch of 4"):
        Trainer.from_config(cfg, use_ray=False)
    assert not (tmp_path / "run").exists()


def test_the_critic_and_the_reward_model_name_their_own_micro_batch_keys(tmp_path: Path) -> None:
    cfg = tiny_run_config(
        str(tmp_path), [*SHORT, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=12"]
    )
    problem = last_batch_problem(cfg, 64)
    assert problem is not None and "critic.ppo_micro_batch_size_per_gpu=12" in problem
    model = tmp_path / "reward_model"
    model.mkdir()
    with pytest.raises(
        ConfigError, match=r"reward_model.micro_batch_size_per_gpu=5 does not divide the 32 sequences"
    ):
        tiny_run_config(
            str(tmp_path), [f"reward_model.path={model}", "reward_model.micro_batch_size_per_gpu=5"]
        )
