"""``RunLog`` never writes over an earlier run's ``metrics.jsonl``: a resume appends to it; a fresh run that
reached it unchecked (the drivers refuse one before they start) keeps it aside as ``metrics.<k>.jsonl`` and
says so in one line. A resumed run's plot draws the whole run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.logs import run_log
from mcore_rl.logs.config import LoggingConfig
from mcore_rl.logs.run_log import RunLog, previous_log


def _cfg(folder: Path) -> LoggingConfig:
    return LoggingConfig(log_dir=str(folder), progress_bar=False, plot=False)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_fresh_log_keeps_the_earlier_one_aside(tmp_path: Path, capsys) -> None:
    earlier = '{"stage": "rl", "step": 1, "reward": 0.25}\n'
    (tmp_path / "metrics.jsonl").write_text(earlier)
    (tmp_path / "metrics.1.jsonl").write_text("an even earlier run\n")
    assert previous_log(_cfg(tmp_path)) == str(tmp_path / "metrics.jsonl")
    log = RunLog(_cfg(tmp_path), total_steps=2)
    log.write("rl", 1, {"reward": 0.5})
    log.close()
    assert (tmp_path / "metrics.2.jsonl").read_text() == earlier  # the earlier runs' logs, both whole
    assert (tmp_path / "metrics.1.jsonl").read_text() == "an even earlier run\n"
    (record,) = _lines(tmp_path / "metrics.jsonl")
    assert record.pop("time/timestamp") == log.records[0]["time/timestamp"]
    assert record == {"stage": "rl", "step": 1, "reward": 0.5}
    assert (
        f"kept the earlier run's {tmp_path}/metrics.jsonl as {tmp_path}/metrics.2.jsonl"
        in capsys.readouterr().err
    )


def test_a_resumed_log_appends(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"stage": "rl", "step": 1}\n')
    log = RunLog(_cfg(tmp_path), total_steps=2, start_step=1)
    log.write("rl", 2, {})
    log.close()
    written = [(r["stage"], r["step"]) for r in _lines(tmp_path / "metrics.jsonl")]
    assert written == [("rl", 1), ("resume", 1), ("rl", 2)]  # the marker: the steps after 1 start again
    assert not (tmp_path / "metrics.1.jsonl").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert previous_log(_cfg(tmp_path / "empty")) is None  # an empty log is nothing to keep


def test_each_stage_has_its_own_progress_bar(tmp_path: Path, capsys) -> None:
    """The SFT warm start and RL each get a bar counting their own steps: SFT stopped at its target leaves its
    line (2 of 5 steps, its loss) and RL's bar starts at 0, not at SFT's step; a test record moves neither."""
    cfg = LoggingConfig(log_dir=str(tmp_path), progress_bar=True, plot=False)
    log = RunLog(cfg, total_steps=3, stage_steps={"sft": 5})
    log.write("test", 0, {"when": "before", "accuracy": 0.0})
    log.write("sft", 1, {"loss": 2.5})
    log.write("sft", 2, {"loss": 1.25, "val_accuracy": 0.5})
    for step in (1, 2, 3):
        log.write("rl", step, {"reward": step / 4})
    log.close()
    lines = [
        line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()
    ]
    sft_line = [line for line in lines if line.startswith("sft:")][-1]
    rl_line = [line for line in lines if line.startswith("rl:")][-1]
    assert "2/5" in sft_line and "loss=1.250" in sft_line and "val_accuracy=0.500" in sft_line
    assert "3/3" in rl_line and "reward=0.750" in rl_line
    assert not any(line.startswith("test") for line in lines)


def test_each_redraw_shows_its_own_step_and_keeps_the_last_validation(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(run_log, "BAR_MIN_INTERVAL_S", 0.0)  # redraw at every step
    log = RunLog(LoggingConfig(log_dir=str(tmp_path), progress_bar=True, plot=False), total_steps=3)
    log.write("rl", 1, {"reward": 0.25, "val_accuracy": 0.5})
    log.write("rl", 2, {"reward": 0.5})
    log.write("rl", 3, {"reward": 0.75})
    log.close()
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    for step in (1, 2, 3):
        drawn = [line for line in lines if f" {step}/3 " in line]
        assert drawn and all(f"reward={step / 4:.3f}" in line for line in drawn), (step, drawn)
        assert all("val_accuracy=0.500" in line for line in drawn)


def test_a_resumed_bar_starts_at_the_resumed_step(tmp_path: Path, capsys) -> None:
    cfg = LoggingConfig(log_dir=str(tmp_path), progress_bar=True, plot=False)
    (tmp_path / "metrics.jsonl").write_text('{"stage": "rl", "step": 1}\n')
    log = RunLog(cfg, total_steps=4, start_step=3)
    log.write("rl", 4, {"reward": 1.0})
    log.close()
    assert "4/4" in capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]


def test_each_record_carries_the_wall_clock_it_was_written_at(tmp_path: Path) -> None:
    """``time/timestamp`` (Unix seconds): the gaps between steps are the whole loop, the driver included."""
    import time

    log = RunLog(_cfg(tmp_path), total_steps=2)
    before = time.time()
    log.write("rl", 1, {"reward": 0.5})
    time.sleep(0.05)
    log.write("rl", 2, {"reward": 0.75})
    after = time.time()
    log.close()
    stamps = [r["time/timestamp"] for r in _lines(tmp_path / "metrics.jsonl")]
    assert before - 1e-3 <= stamps[0] < stamps[1] <= after + 1e-3
    assert stamps[1] - stamps[0] >= 0.045


def test_a_resumed_run_plots_the_whole_run(tmp_path: Path) -> None:
    """The plot at the end of a run resumed twice, each time interrupted past its checkpoint: the evaluation
    before step 1 and every step once, from the process that ran it last (the records after each resumed step
    were superseded by the steps run again)."""
    cfg = LoggingConfig(log_dir=str(tmp_path), progress_bar=False, plot=True)
    drawn: list[list[tuple[str, int, int]]] = []

    def draw(records: list[dict], log_dir: str) -> None:
        drawn.append([(r["stage"], r["step"], r["process"]) for r in records])

    def process(number: int, start_step: int, steps: list[int]) -> None:  # as DPOTrainer.fit logs
        log = RunLog(cfg, 6, progress_stage="train", plot=draw, start_step=start_step)
        if not start_step:
            log.write("eval", 0, {"process": number})
        for step in steps:
            log.write("train", step, {"process": number})
            if step % 2 == 0:  # an evaluation, then a checkpoint
                log.write("eval", step, {"process": number})
        log.close()

    process(1, 0, [1, 2, 3])  # checkpoint at 2, interrupted after step 3
    process(2, 2, [3, 4, 5])  # resumed at 2; checkpoint at 4, interrupted after step 5
    process(3, 4, [5, 6])  # resumed at 4
    before_step_3 = [("eval", 0, 1), ("train", 1, 1), ("train", 2, 1), ("eval", 2, 1)]
    before_step_5 = [*before_step_3, ("train", 3, 2), ("train", 4, 2), ("eval", 4, 2)]
    assert drawn[1] == [*before_step_5, ("train", 5, 2)]
    assert drawn[2] == [*before_step_5, ("train", 5, 3), ("train", 6, 3), ("eval", 6, 3)]
    lines = _lines(tmp_path / "metrics.jsonl")  # the log itself keeps everything written, and says where
    assert len(lines) == 14 and [(r["stage"], r["step"]) for r in lines if r["stage"] == "resume"] == [
        ("resume", 2),
        ("resume", 4),
    ]


def test_a_resume_supersedes_the_steps_after_its_checkpoint_in_every_reader(tmp_path: Path) -> None:
    """A resumed run's repeated steps were told apart only by the plot's rule: jq, pandas and TensorBoard saw
    step 3 twice. The marker record names the step the run continued after, and TensorBoard's events after it
    are purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(log_dir=str(tmp_path), progress_bar=False, plot=False, tensorboard=True)
    first = RunLog(cfg, 4)
    for step in (1, 2, 3):  # checkpoint at 2, interrupted after step 3
        first.write("rl", step, {"reward": float(step)})
    first.close()
    resumed = RunLog(cfg, 4, start_step=2)
    for step in (3, 4):
        resumed.write("rl", step, {"reward": 10.0 * step})
    resumed.close()
    standing = run_log.standing_records(
        run_log.read_records(str(tmp_path / "metrics.jsonl")), "rl", run_log.records_up_to
    )
    assert [(r["stage"], r["step"], r.get("reward")) for r in standing] == [
        ("rl", 1, 1.0),
        ("rl", 2, 2.0),
        ("rl", 3, 30.0),
        ("rl", 4, 40.0),
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rl/reward")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]


def test_lines_are_strict_json_and_a_torn_line_costs_no_record(tmp_path: Path) -> None:
    """``json.dumps`` wrote ``Infinity`` / ``NaN``, which JSON parsers refuse; a resume appended onto a line a
    crash cut short, losing its own first record with it."""
    log = RunLog(_cfg(tmp_path), 3)
    log.write("rl", 1, {"ratio": float("inf"), "extra": {"x": float("nan")}, "reward": 0.5})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": "rl", "ste')  # step 2, torn by a crash
    resumed = RunLog(_cfg(tmp_path), 3, start_step=1)
    resumed.write("rl", 2, {"reward": 0.75})
    resumed.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    records = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
        for line in text.splitlines()[:1]
    ]
    assert records[0]["ratio"] is None and records[0]["extra"] == {"x": None} and records[0]["reward"] == 0.5
    assert [(r["stage"], r["step"]) for r in run_log.read_records(str(tmp_path / "metrics.jsonl"))] == [
        ("rl", 1),
        ("resume", 1),
        ("rl", 2),
    ]


def test_held_out_tests_at_one_step_keep_their_own_tensorboard_tags(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(LoggingConfig(log_dir=str(tmp_path), progress_bar=False, plot=False, tensorboard=True), 2)
    log.write("test", 0, {"when": "before", "accuracy": 0.25})
    log.write("test", 0, {"when": "after_sft", "accuracy": 0.5})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("test/before/accuracy")] == [(0, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("test/after_sft/accuracy")] == [(0, 0.5)]
