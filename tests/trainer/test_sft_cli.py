"""The ``start RL from it`` line ``mcore-rl sft`` prints is a command that works: read back as a shell reads
it, its config loads and its run folder passes the checks a run makes before it writes (it named the SFT run
folder, which holds the RL run's input, and was refused)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from mcore_rl.trainer.sft import SFTSummary
from tests.models import tiny_hf_config


def _sft_run_folder(run: Path) -> Path:
    """What an SFT run leaves: our marker, config.yaml, logs/metrics.jsonl, sft_checkpoint/ and model/."""
    from mcore_rl.io.output import MARKER_FILE

    (run / "logs").mkdir(parents=True)
    (run / MARKER_FILE).write_text('{"tool": "mcore_rl"}')
    (run / "config.yaml").write_text("{}")
    (run / "logs" / "metrics.jsonl").write_text('{"stage": "sft", "step": 1, "loss": 1.0}\n')
    (run / "sft_checkpoint").mkdir()
    model = run / "model"
    model.mkdir()
    hf = tiny_hf_config("llama", vocab_size=14, max_position_embeddings=1024, tie_word_embeddings=True)
    (model / "config.json").write_text(json.dumps(hf))
    (model / "tokenizer.json").write_text("{}")
    return model


def _printed_rl_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """``mcore-rl sft ARGV``'s ``start RL from it`` line, the SFT run itself faked (its folder is on disk)."""
    import mcore_rl.trainer.sft as sft
    from mcore_rl.cli import main
    from mcore_rl.config import load_config

    keys = [a for a in argv[2:] if a != "--in-process"]
    cfg = load_config(argv[1], [*keys, "sft.enable=true"])
    run = Path(cfg.trainer.default_local_dir)
    model = _sft_run_folder(run)

    def fake_run_sft(config, overrides=(), use_ray=True):
        return SFTSummary(2, 1.0, 0.5, None, None, str(model), str(run / "sft_checkpoint"), str(run / "logs"))

    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    assert main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("start RL from it: ")]
    assert len(lines) == 1
    return lines[0].removeprefix("start RL from it: ")


@pytest.mark.parametrize(
    "overrides",
    [
        ["sft.total_steps=2"],  # the recipe's own run folder (runs/demo)
        ["sft.total_steps=2", "trainer.default_local_dir=runs/my sft", "logging.log_dir=runs/my sft/logs"],
    ],
)
def test_the_printed_rl_command_passes_the_run_folder_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, overrides: list[str]
) -> None:
    from mcore_rl.config import load_config
    from mcore_rl.config.run_folder import check_run_folders

    monkeypatch.chdir(tmp_path)
    line = _printed_rl_line(monkeypatch, capsys, ["sft", "demo_cpu", *overrides, "--in-process"])
    words = shlex.split(line)  # a space in a folder name stays in its word
    assert words[:3] == ["mcore-rl", "train", "demo_cpu"] and words[-1] == "--in-process"
    cfg = load_config(words[2], words[3:-1], max_ranks=1)
    check_run_folders(cfg)  # today's refusal: "... contains an input" (model.path inside the run folder)
    sft_run = Path(overrides[1].split("=", 1)[1]) if len(overrides) > 1 else Path("runs/demo")
    assert Path(cfg.model.path) == sft_run / "model" and not cfg.sft.enable
    assert Path(cfg.trainer.default_local_dir) == Path(f"{sft_run}_rl")
    assert Path(cfg.logging.log_dir) == Path(f"{sft_run}_rl") / "logs"
    assert cfg.sft.total_steps == 2  # the user's other overrides repeated


def test_the_printed_rl_command_leaves_an_earlier_rl_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo_rl").mkdir(parents=True)
    line = _printed_rl_line(monkeypatch, capsys, ["sft", "demo_cpu"])
    assert "trainer.default_local_dir=runs/demo_rl2" in shlex.split(line)


def test_a_finished_sft_run_run_again_is_already_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Found by a review: a finished ``mcore-rl sft`` run again exited 1 with "no run checkpoint in
    runs/sftc/checkpoints to resume" (an SFT run writes none); ``train`` and ``dpo`` say already complete."""
    import mcore_rl.trainer.sft as sft
    from mcore_rl.cli import main
    from mcore_rl.config import load_config
    from mcore_rl.config.run_folder import check_run_folders
    from mcore_rl.io.errors import OutputError
    from mcore_rl.io.output import MARKER_FILE

    monkeypatch.chdir(tmp_path)
    model = _sft_run_folder(tmp_path / "runs" / "sftc")
    (model / MARKER_FILE).write_text('{"tool": "mcore_rl"}')  # exported by us, as a real run's is
    (tmp_path / "runs" / "sftc" / "logs" / "metrics.jsonl").write_text(
        "".join(json.dumps({"stage": "sft", "step": n, "loss": 1.0}) + "\n" for n in (10, 20))
    )
    monkeypatch.setattr(sft, "run_sft", lambda *a, **k: pytest.fail("a finished run trains nothing"))
    keys = ["sft.total_steps=20", "trainer.save_freq=10", "trainer.default_local_dir=runs/sftc"]
    assert main(["sft", "demo_cpu", *keys, "logging.log_dir=runs/sftc/logs", "--in-process"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("already complete at step 20 (runs/sftc/model); nothing to train\n")
    # more steps asked for: refused as before, but saying why and what to do (an SFT run cannot resume)
    cfg = load_config("demo_cpu", [*keys, "sft.total_steps=40", "logging.log_dir=runs/sftc/logs"])
    with pytest.raises(
        OutputError,
        match=r"holds a finished SFT run \(20 steps, its model in runs/sftc/model\)"
        r".*cannot resume\): set trainer.default_local_dir to another folder",
    ):
        check_run_folders(cfg)
