"""``reward.png`` reads the run's records stage by stage: SFT and RL each on their own step axis (an RL step is
not an SFT step), greedy validation apart from the sampled training reward, the held-out test as marks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mcore_rl.logs.plots import reward_plot, reward_series


def _records(sft_steps: int) -> list[dict]:
    records: list[dict] = [{"stage": "test", "step": 0, "when": "before", "accuracy": 0.0}]
    for step in range(1, sft_steps + 1):
        records.append(
            {
                "stage": "sft",
                "step": step,
                "loss": 2.0 / step,
                **({"val_accuracy": 0.1 * step} if step % 2 == 0 else {}),
            }
        )
    if sft_steps:
        records.append({"stage": "test", "step": 0, "when": "after_sft", "accuracy": 0.3})
    for step in range(1, 5):
        records.append(
            {
                "stage": "rl",
                "step": step,
                "reward": 0.2 + 0.05 * step,
                **({"val_accuracy": 0.9} if step == 4 else {}),
            }
        )
    records.append({"stage": "test", "step": 4, "when": "after_rl", "accuracy": 0.8})
    return records


def test_each_stage_keeps_its_own_steps_and_the_held_out_marks_close_them() -> None:
    series = reward_series(_records(sft_steps=4))
    assert series["sft_val_accuracy"] == [(2, 0.2), (4, 0.4)]  # SFT steps, never shifted onto the RL axis
    assert [s for s, _ in series["rl_reward"]] == [1, 2, 3, 4] and series["rl_val_accuracy"] == [(4, 0.9)]
    assert series["test_sft"] == [(0, 0.0), (4, 0.3)]  # before SFT, and after its last step
    assert series["test_rl"] == [(0, 0.3), (4, 0.8)]  # RL starts from the SFT model, ends at its last step


def test_without_sft_the_first_held_out_mark_starts_rl_and_no_sft_panel_is_drawn(tmp_path) -> None:
    series = reward_series(_records(sft_steps=0))
    assert series["test_sft"] == [] and series["test_rl"] == [(0, 0.0), (4, 0.8)]
    assert reward_plot(_records(sft_steps=0), str(tmp_path)) == str(tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 1000


def _drawn_panels() -> Iterator[tuple[str, Any]]:
    """Each stage's panel of a small run, drawn (Agg) as ``reward_plot`` draws it: ``(stage, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mcore_rl.logs.plots import _draw_stage

    series = reward_series(_records(sft_steps=3))
    for stage in ("sft", "rl"):
        fig, ax = plt.subplots()
        _draw_stage(ax, stage, series)
        fig.canvas.draw()
        yield stage, ax
        plt.close(fig)


def test_the_step_axes_tick_whole_steps_only() -> None:
    for stage, ax in _drawn_panels():
        ticks = ax.get_xticks()
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (stage, ticks)


def test_the_legend_sits_outside_the_data() -> None:
    """Inside the axes it hid the held-out mark that ends the RL panel (seen in a demo run's plot)."""
    for stage, ax in _drawn_panels():
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 <= ax.get_window_extent().y0, stage  # wholly below the axes


def test_rewards_below_zero_are_drawn() -> None:
    """The axis was fixed to [0, 1]: a +-1 rule's mean rewards (here about -0.4) fell outside it, unseen."""
    import matplotlib.pyplot as plt

    from mcore_rl.logs.plots import _draw_stage

    records = [{"stage": "rl", "step": s, "reward": -0.4 - 0.05 * s} for s in range(1, 5)]
    fig, ax = plt.subplots()
    _draw_stage(ax, "rl", reward_series(records))
    low, high = ax.get_ylim()
    assert low < -0.6 and high >= 1.0
    plt.close(fig)


def test_a_dpo_run_without_held_out_pairs_plots_without_a_legend_warning(tmp_path) -> None:
    """matplotlib warned 'No artists with labels found to put in legend' at the end of such a run."""
    import warnings

    from mcore_rl.logs.plots import dpo_plot

    records = [
        {"stage": "train", "step": s, "loss": 0.7 - 0.1 * s, "rewards/accuracies": 0.5} for s in (1, 2)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = dpo_plot(records, str(tmp_path))
    assert path is not None and (tmp_path / "dpo.png").stat().st_size > 0
