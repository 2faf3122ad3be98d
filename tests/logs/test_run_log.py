"""``RunLog`` never writes over an earlier run's ``metrics.jsonl``: a resume appends to it; a fresh run that
reached it unchecked (the drivers refuse one before they start) keeps it aside as ``metrics.<k>.jsonl`` and
says so in one line. A resumed run's plot draws the whole run."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2]
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
    assert len(_lines(tmp_path / "metrics.jsonl")) == 12  # the log itself keeps everything written
