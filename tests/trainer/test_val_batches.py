"""``data.val_batch_size``: validation during training generates that many prompts per call, as ``mcore-rl eval``
does, each call with its own seed; the mean and the logged samples are over the whole set."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import QUIET, tiny_run_config


def test_validation_generates_val_batch_size_prompts_per_call(tmp_path: Path) -> None:
    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [
            *QUIET,
            "data.val_batch_size=5",
            "logging.log_val_generations=7",
            "rollout.val_kwargs.temperature=1.0",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        step, val = trainer._step, trainer.data.val
        assert val is not None and len(val) == 16
        calls: list[tuple[int, int | None]] = []
        generate = step.actors.generate

        def counted(request, sampling):  # passes through: the real engine generates
            calls.append((len(request.prompt_ids), sampling.seed))
            return generate(request, sampling)

        step.actors.generate = counted
        result = step.evaluate(val)
        samples = step.take_val_samples()
    assert [size for size, _ in calls] == [5, 5, 5, 1]
    seeds = [seed for _, seed in calls]
    assert len(set(seeds)) == 4 and seeds == list(range(seeds[0], seeds[0] + 4))  # each call its own seed
    assert 0.0 <= result.accuracy <= 1.0 and 0.0 <= result.reward <= 1.0
    # the first 7 prompts of the set, in order, one sample each, across the first two calls
    assert [s["prompt"] for s in samples] == [trainer.data.tokenizer.decode(p) for p in val.prompt_ids[:7]]


PLUS_MINUS_ONE = '''
def score(data_source, solution_str, ground_truth, extra_info):
    """math_dapo's convention: 1 right, -1 wrong (here: by a property of the row)."""
    return 1.0 if str(ground_truth)[-1:] in "01234" else -1.0
'''


def test_validation_accuracy_is_the_share_answered_right(tmp_path: Path) -> None:
    """With a +-1 rule the mean reward is 2 x accuracy - 1: it was logged as val_accuracy (and SFT stopped
    early on it); the accuracy is the share of samples reaching the full score, as ``mcore-rl eval`` counts."""
    scorer = tmp_path / "scorer.py"
    scorer.write_text(PLUS_MINUS_ONE)
    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [*QUIET, f"reward.custom_function={scorer}:score", f"trainer.default_local_dir={tmp_path / 'run'}"],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        val = trainer.data.val
        result = trainer._step.evaluate(val)
    right = sum(str(t)[-1:] in "01234" for t in val.ground_truths) / len(val)
    assert 0 < right < 1
    assert abs(result.accuracy - right) < 1e-9  # every sample of a prompt scores alike here
    assert abs(result.reward - (2 * right - 1)) < 1e-9
