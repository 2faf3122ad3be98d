"""Experiment trackers and sample generations in the run log, without a network: every record reaches W&B
(a stand-in module checks the exact calls; the real one runs offline) and MLflow (a file store under the log
folder, read back), one step axis per stage; an absent library is named with its pip command; validation
samples land in generations.jsonl and TensorBoard with the record that follows them."""

from __future__ import annotations

import json
import struct
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from mcore_rl.config import load_config
from mcore_rl.io.fields import FieldError
from mcore_rl.logs.config import LoggingConfig
from mcore_rl.logs.generations import GENERATIONS_FILE
from mcore_rl.logs.run_log import RunLog
from mcore_rl.logs.trackers import numbers
from tests.models import tiny_hf_config

RECORDS = [
    ("sft", 1, {"loss": 2.0, "lr": 1e-3}),
    ("sft", 2, {"loss": 1.5, "val_accuracy": 0.25}),
    ("test", 2, {"when": "after_sft", "accuracy": 0.5}),
    ("rl", 1, {"reward": 0.5, "skipped": float("nan"), "on": True}),
    ("rl", 2, {"reward": 0.75}),
]


def _log(tmp_path: Path, **fields: Any) -> LoggingConfig:
    base = {"log_dir": str(tmp_path / "logs"), "progress_bar": False, "plot": False, "jsonl": False}
    return LoggingConfig(
        **{"tracker_project": "proj", "tracker_run_name": "exp", "mlflow_tracking_uri": "", **base, **fields}
    )


def _write(cfg: LoggingConfig, **kwargs: Any) -> RunLog:
    log = RunLog(cfg, 2, **kwargs)
    for stage, step, metrics in RECORDS:
        log.write(stage, step, metrics)
    log.close()
    return log


def test_numbers_are_the_finite_values_by_stage() -> None:
    assert numbers("rl", {"reward": 1, "x": float("inf"), "when": "before", "on": True, "k": [1]}) == {
        "rl/reward": 1.0
    }


class FakeRun:
    def __init__(self, **init: Any) -> None:
        self.init, self.calls = init, list[tuple[str, Any]]()

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.calls.append(("define", (name, step_metric)))

    def log(self, data: dict[str, float]) -> None:
        self.calls.append(("log", data))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def test_wandb_gets_every_record_on_one_step_axis_per_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **init: runs.append(FakeRun(**init)) or runs[-1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _write(_log(tmp_path, wandb=True))
    (run,) = runs
    assert run.init == {"project": "proj", "name": "exp", "dir": str(tmp_path / "logs"), "mode": "offline"}
    assert run.calls == [
        ("define", ("sft/step", None)),
        ("define", ("sft/*", "sft/step")),
        ("log", {"sft/loss": 2.0, "sft/lr": 1e-3, "sft/step": 1}),
        ("log", {"sft/loss": 1.5, "sft/val_accuracy": 0.25, "sft/step": 2}),
        ("define", ("test/step", None)),
        ("define", ("test/*", "test/step")),
        ("log", {"test/accuracy": 0.5, "test/step": 2}),
        ("define", ("rl/step", None)),
        ("define", ("rl/*", "rl/step")),
        ("log", {"rl/reward": 0.5, "rl/step": 1}),
        ("log", {"rl/reward": 0.75, "rl/step": 2}),
        ("finish", None),
    ]


def test_mlflow_file_store_under_the_log_folder_holds_every_metric(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "data.train_files=[x.jsonl]",
            f"model.hf_config={json.dumps(tiny_hf_config(max_position_embeddings=1024))}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.project_name=proj",
            "logging.mlflow=true",
        ],
    ).logging
    assert cfg.mlflow_tracking_uri == str(tmp_path / "run" / "logs" / "mlruns")
    _write(cfg)
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    history = {
        k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
        for k in run.data.metrics
    }
    assert history == {
        "sft/loss": [(1, 2.0), (2, 1.5)],
        "sft/lr": [(1, 1e-3)],
        "sft/val_accuracy": [(2, 0.25)],
        "test/accuracy": [(2, 0.5)],
        "rl/reward": [(1, 0.5), (2, 0.75)],
    }


def test_absent_tracker_is_named_with_its_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(
        FieldError, match=r"logging.wandb=True must be false, or wandb installed: pip install wandb"
    ):
        LoggingConfig(wandb=True)
    with pytest.raises(FieldError, match=r"pip install mlflow-skinny"):
        LoggingConfig(mlflow=True)
    with pytest.raises(
        FieldError, match=r"logging\.wandb_mode=.cloud. is not allowed; choose one of: offline"
    ):
        LoggingConfig(wandb_mode="cloud")
    with pytest.raises(FieldError, match=r"logging\.log_val_generations=-1 must be >= 0"):
        LoggingConfig(log_val_generations=-1)


def test_validation_samples_go_to_generations_jsonl_and_tensorboard(tmp_path: Path) -> None:
    pending = [
        [],
        [{"data_source": "d", "prompt": "1+1=", "response": "2", "ground_truth": "2", "score": 1.0}],
    ]
    pending += [
        [],
        [{"data_source": "d", "prompt": "1+2=", "response": "4|x", "ground_truth": "3", "score": 0.0}],
    ]
    pending.append([])
    cfg = _log(tmp_path, tensorboard=True)
    _write(cfg, samples=lambda: pending.pop(0))
    rows = [json.loads(line) for line in (tmp_path / "logs" / GENERATIONS_FILE).read_text().splitlines()]
    assert [(r["stage"], r["step"], r["prompt"], r["score"]) for r in rows] == [
        ("sft", 2, "1+1=", 1.0),
        ("rl", 1, "1+2=", 0.0),
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("rl/generations/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| data_source | prompt | response | ground_truth | score |" in table
    assert "| d | 1+2= | 4\\|x | 3 | 0.0 |" in table


def test_wandb_offline_run_is_written_under_the_log_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real library, offline (its default mode here): no network, a run folder ``wandb sync`` uploads,
    holding every record on its stage's step axis (read back from the run file)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write(_log(tmp_path, wandb=True))
    (run,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    (records,) = run.glob("run-*.wandb")
    # W&B's core is a process of its own that may still be writing the file when finish() has returned
    # (a full CI run under load read it empty once): wait for the history, up to a bound
    deadline = time.monotonic() + 30
    while not (history := _wandb_history(records)) and time.monotonic() < deadline:
        time.sleep(0.2)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history]
    assert rows == [
        {"sft/loss": 2.0, "sft/lr": 1e-3, "sft/step": 1},
        {"sft/loss": 1.5, "sft/val_accuracy": 0.25, "sft/step": 2},
        {"test/accuracy": 0.5, "test/step": 2},
        {"rl/reward": 0.5, "rl/step": 1},  # NaN and the flag are not numbers a chart can plot
        {"rl/reward": 0.75, "rl/step": 2},
    ]


def _wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of an offline ``.wandb`` run file: a 7-byte header, then LevelDB's log format (32 KiB
    blocks of records: crc32, length, type: full, or first/middle/last pieces) of ``Record`` protobufs
    (wandb 0.2x+ reads them in its Go core; no Python reader is left)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, records, piece = path.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            piece = (piece if kind == 3 else b"") + chunk
        elif kind == 4:
            records.append(piece + chunk)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows
