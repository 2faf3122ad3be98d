"""``mcore-rl`` itself: every expected failure is one ``error:`` line with exit 1 (not an "internal error"),
the same unknown key exits alike from ``config show`` and ``train``, and ``key=value`` overrides may follow a
flag in every command that takes them (parsed only: nothing runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.cli import _report, main, parse_command
from mcore_rl.config import ConfigError
from mcore_rl.data.rows import DataError
from mcore_rl.data.tokenizer import TokenizerError
from mcore_rl.engine.rollout.base import SamplingParams, SamplingParamsError
from mcore_rl.engine.rollout.layout import RolloutLayoutError
from mcore_rl.io.errors import InputError
from mcore_rl.planner.spec import PlanError
from mcore_rl.scoring.registry import ScorerError

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "recipes" / "demo_cpu.yaml")

INPUT_ERRORS = [ConfigError, DataError, TokenizerError, ScorerError, SamplingParamsError, PlanError]


@pytest.mark.parametrize("error", [*INPUT_ERRORS, RolloutLayoutError], ids=lambda e: e.__name__)
def test_every_input_error_is_one_error_line_with_exit_1(error: type[Exception], capsys) -> None:
    assert issubclass(error, InputError) and issubclass(error, ValueError)  # `except ValueError` still holds
    assert _report("mcore-rl train", error("data/train.parquet: no such data file"), debug=False) == 1
    assert capsys.readouterr().err == "mcore-rl train: error: data/train.parquet: no such data file\n"


def test_a_sampling_parameter_out_of_range_is_an_input_error(capsys) -> None:
    with pytest.raises(InputError) as info:
        SamplingParams(temperature=-1.0)
    assert _report("mcore-rl dpo", info.value, debug=False) == 1
    assert capsys.readouterr().err.startswith("mcore-rl dpo: error: temperature must be >= 0")


def test_an_input_error_raised_on_a_worker_names_the_rank_not_a_traceback(capsys) -> None:
    from mcore_rl.controller.worker_group import WorkerError

    cause = DataError("sft.parquet: row 3: column 'response': missing")
    err = WorkerError(2, "sft_step", "Traceback (most recent call last): ...", cause=cause)
    assert _report("mcore-rl sft", err, debug=False) == 1
    assert (
        capsys.readouterr().err
        == "mcore-rl sft: rank 2: error: sft.parquet: row 3: column 'response': missing\n"
    )


def test_fault_exit_codes_are_the_documented_ones(capsys) -> None:
    """README "Faults and recovery": 75 after a stop with its checkpoint saved, 128 + signum for an interrupt
    (also one torch's checkpoint writer gathered as a rank's failure), 1 for a lost or hung rank."""
    import signal

    from torch.distributed.checkpoint.api import CheckpointException

    from mcore_rl.controller.worker_group import WorkerError
    from mcore_rl.io.errors import EXIT_PREEMPTED, Interrupted, Preempted

    assert EXIT_PREEMPTED == 75
    assert (
        _report("mcore-rl train", Preempted(signal.SIGUSR1, 7, "run/checkpoints/global_step_7"), False) == 75
    )
    assert capsys.readouterr().err == (
        "mcore-rl train: stopped by SIGUSR1 after step 7; run checkpoint run/checkpoints/global_step_7 saved; "
        "the same command resumes it\n"
    )
    inside_save = CheckpointException("write_data", {0: (Interrupted(signal.SIGHUP), None)})
    assert _report("mcore-rl convert", inside_save, False) == 129
    assert capsys.readouterr().err == "mcore-rl convert: interrupted by SIGHUP; partial output removed\n"
    hung = WorkerError(1, "update", "phase 'update' made no progress for 30 s", kind=WorkerError.HUNG)
    assert _report("mcore-rl train", hung, False) == 1
    assert capsys.readouterr().err == "mcore-rl train: error: phase 'update' made no progress for 30 s\n"


def test_anything_else_is_still_an_internal_error(capsys) -> None:
    assert _report("mcore-rl train", KeyError("x"), debug=False) == 1
    assert "internal error: KeyError" in capsys.readouterr().err


def test_unknown_key_exits_1_from_config_show_and_from_train(tmp_path: Path, capsys) -> None:
    """One exit status for one mistake: 1 (an input error), as the README says; 2 is argparse's bad flags."""
    assert main(["config", "show", DEMO, "rollout.m=4"]) == 1
    shown = capsys.readouterr().err
    run = f"trainer.default_local_dir={tmp_path}/run"
    assert main(["train", DEMO, "--in-process", run, "rollout.m=4"]) == 1
    trained = capsys.readouterr().err
    for err, prog in ((shown, "config"), (trained, "train")):
        assert err.startswith(f"mcore-rl {prog}: error: unknown key rollout.m (overrides)"), err
    assert not (tmp_path / "run").exists()


def test_train_reports_tokenizer_and_data_errors_as_input_errors(tmp_path: Path, capsys) -> None:
    from tests.data.conftest import train_bpe

    common = [DEMO, "--in-process", f"trainer.default_local_dir={tmp_path}/run", "data.generate=null"]
    assert main(["train", *common, f"model.tokenizer_path={tmp_path}/no_tokenizer"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mcore-rl train: error: invalid run config"), err
    assert f"model.tokenizer_path: {tmp_path}/no_tokenizer does not exist" in err, err

    tokenizer = train_bpe(tmp_path / "tok", with_config=True)
    missing = f"data.train_files=[{tmp_path}/none.parquet]"
    assert main(["train", *common, f"model.tokenizer_path={tokenizer}", missing]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mcore-rl train: error: invalid run config"), err
    assert f"data.train_files: {tmp_path}/none.parquet does not exist" in err, err


def test_a_missing_model_folder_is_named_as_itself(tmp_path: Path, capsys) -> None:
    """Not as the tokenizer error that reading it (model.tokenizer_path defaults to model.path) would give."""
    common = [DEMO, "--in-process", f"trainer.default_local_dir={tmp_path}/run", "model.hf_config={}"]
    common.append("data.generate=null")  # the demo's data may be absent too (a fresh clone): named alike
    no_model = [
        f"model.path={tmp_path}/no_model",
        "model.tokenizer_path=${model.path}",
    ]  # the schema's default
    assert main(["train", *common, *no_model]) == 1
    err = capsys.readouterr().err
    assert f"model.path: {tmp_path}/no_model does not exist" in err and "no such tokenizer" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_without_tokenizer_files_asks_for_the_tokenizer(tmp_path: Path, capsys) -> None:
    from tests.models import tiny_hf_config

    ckpt = tmp_path / "sft_checkpoint"  # a model checkpoint without hf_assets/ (an older run's)
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    info = {"hf_config": tiny_hf_config("llama", max_position_embeddings=2048), "dtype": "float32"}
    (ckpt / "mcore_rl_model.json").write_text(json.dumps({**info, "format_version": 1, "extra": {}}))
    overrides = [
        f"model.path={ckpt}",
        f"model.tokenizer_path={ckpt}",
        "model.hf_config={}",
        "sft.enable=false",
        "data.generate=null",
    ]
    assert main(["train", DEMO, "--in-process", f"trainer.default_local_dir={tmp_path}/run", *overrides]) == 1
    err = capsys.readouterr().err
    assert f"model.path={ckpt} is a megatron checkpoint without the tokenizer files" in err, err
    assert "set model.tokenizer_path" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", "r.yaml", "--in-process", "trainer.total_training_steps=1", "rollout.n=2"],
            {
                "recipe": "r.yaml",
                "overrides": ["trainer.total_training_steps=1", "rollout.n=2"],
                "in_process": True,
            },
        ),
        (
            ["train", "r.yaml", "a=1", "--in-process", "b=2"],
            {"overrides": ["a=1", "b=2"], "in_process": True},
        ),
        (["sft", "r.yaml", "--in-process", "sft.total_steps=3"], {"overrides": ["sft.total_steps=3"]}),
        (
            ["dpo", "r.yaml", "dpo.beta=0.2", "dpo.loss_type=ipo"],
            {"overrides": ["dpo.beta=0.2", "dpo.loss_type=ipo"]},
        ),
        (
            ["plan", "r.yaml", "--gpu", "A100-40", "data.train_batch_size=8", "--recompute", "full", "k=v"],
            {"recipe": "r.yaml", "overrides": ["data.train_batch_size=8", "k=v"], "gpu": "A100-40"},
        ),
        (
            ["config", "show", "r.yaml", "--check-paths", "rollout.n=4", "--check", "rollout.top_k=3"],
            {
                "action": "show",
                "recipe": "r.yaml",
                "overrides": ["rollout.n=4", "rollout.top_k=3"],
                "check": True,
            },
        ),
        # no recipe: run() takes the first positional as an override
        (["config", "show", "rollout.n=4"], {"recipe": "rollout.n=4", "overrides": []}),
        (["config", "show"], {"recipe": None, "overrides": [], "check_paths": False}),
        (
            ["convert", "hf-to-mcore", "--hf-dir", "a", "--out", "b"],
            {"direction": "hf-to-mcore", "hf_dir": "a"},
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_overrides_may_follow_a_flag(argv: list[str], expected: dict[str, object]) -> None:
    _, args = parse_command(argv)
    assert {key: getattr(args, key) for key in expected} == expected


def test_a_bad_flag_is_still_argparse_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_command(["train", "r.yaml", "--no-such-flag", "a=1"])
    assert info.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_sft_help_shows_an_sft_override(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_command(["sft", "--help"])
    out = capsys.readouterr().out
    assert "sft.total_steps=20" in out and "trainer.total_training_steps" not in out
    with pytest.raises(SystemExit):
        parse_command(["train", "--help"])
    assert "trainer.total_training_steps=20" in capsys.readouterr().out


def test_verbose_anywhere_keeps_the_ranks_output_on_the_console(monkeypatch, capsys) -> None:
    """``--verbose`` (any position, like ``--debug``) is taken out of the command's arguments and turns the
    per-rank log files off: the worker spec then carries no output folder (Ray's INFO lines follow the same
    variable in controller.resources)."""
    from mcore_rl.config import load_config
    from mcore_rl.trainer.build import worker_output_dir

    monkeypatch.delenv("MCORE_RL_VERBOSE", raising=False)
    cfg = load_config(DEMO)
    assert worker_output_dir(cfg) == f"{cfg.logging.log_dir}/workers"
    assert main(["config", "show", DEMO, "--verbose", "trainer.total_training_steps=3"]) == 0
    assert "total_training_steps: 3" in capsys.readouterr().out
    assert worker_output_dir(cfg) is None
