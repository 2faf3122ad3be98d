"""The DPO trainer at DP2 on the 2-rank pool: TRL metrics and run logs; an interrupted run resumed from its
checkpoint continues exactly as the uninterrupted one; precomputed reference log-probs give the same step as
the frozen reference model; the checkpoint converts to HF; ``mcore-rl dpo`` refuses a recipe without pairs; a
finished run run again is complete and does nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from mcore_rl.config import ConfigError, RunConfig, check_config, schema_node
from mcore_rl.data.demo_task import splits, write_demo_dataset
from mcore_rl.data.preference import arithmetic_preference_rows
from mcore_rl.data.rows import write_rows
from tests.models import tiny_hf_config

TRL_NAMES = {
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
}


def tiny_dpo_config(folder: str, overrides: list[str] = ()) -> RunConfig:
    """16 pairs per step over DP2 (4 per micro-batch) on a 4-layer h64 Llama with the 14-symbol tokenizer."""
    paths = {s: os.path.join(folder, f"{s}.jsonl") for s in ("pairs", "val_pairs", "test")}
    if not os.path.exists(paths["pairs"]):
        write_demo_dataset(
            {"test": paths["test"], "tokenizer": os.path.join(folder, "tokenizer")}, 1, {"test": 8}
        )
        problems = splits(1, {"train": 64, "val": 12, "test": 8, "sft": 0})
        write_rows(paths["pairs"], arithmetic_preference_rows(problems["train"], seed=1))
        write_rows(paths["val_pairs"], arithmetic_preference_rows(problems["val"], seed=2))
    hf: dict[str, Any] = tiny_hf_config("llama", vocab_size=14, max_position_embeddings=32)
    base = [
        f"dpo.train_files=[{paths['pairs']}]",
        f"dpo.val_files=[{paths['val_pairs']}]",
        f"data.test_files=[{paths['test']}]",
        f"model.tokenizer_path={os.path.join(folder, 'tokenizer')}",
        "data.max_prompt_length=8",
        "data.max_response_length=6",
        "data.train_batch_size=16",
        "dpo.train_batch_size=16",
        "dpo.micro_batch_size_per_gpu=4",
        "dpo.test_freq=2",
        "dpo.sft_loss_weight=0.5",
        "optim.lr=1e-3",
        "optim.weight_decay=0.0",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "logging.progress_bar=false",
        f"trainer.default_local_dir={os.path.join(folder, 'run')}",
    ]
    node = OmegaConf.merge(schema_node(), {"model": {"hf_config": hf}})
    return check_config(OmegaConf.merge(node, OmegaConf.from_dotlist(base + list(overrides))))


def _fit(cfg: RunConfig, stop_after: int | None = None) -> list[dict[str, Any]]:
    from mcore_rl.dpo.trainer import DPOTrainer

    with DPOTrainer.from_config(cfg) as trainer:
        trainer.fit(stop_after=stop_after)
        return trainer.records


def _interrupted_then_resumed(cfg: RunConfig) -> tuple[list, list]:
    first = _fit(cfg, stop_after=3)  # checkpoint at step 2; step 3 is lost with the "crash"
    return first, _fit(cfg)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dpo_run"))


def _train(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if r["stage"] == "train"}


def test_run_logs_trl_metrics_and_resumes_exactly(run_distributed, folder: str) -> None:
    full_cfg = tiny_dpo_config(
        folder, ["trainer.default_local_dir=" + os.path.join(folder, "full"), "logging.tensorboard=true"]
    )
    full = run_distributed(_fit, full_cfg, world_size=2, timeout_s=600)[0]
    steps = _train(full)
    assert sorted(steps) == [1, 2, 3, 4]
    assert set(steps[1]) >= TRL_NAMES and "grad_norm" in steps[1]
    evals = [r for r in full if r["stage"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals[0]["eval_rewards/accuracies"] == 0.0  # policy == reference: every pair ties
    assert 0.0 <= evals[-1]["exact_match"] <= 1.0
    assert steps[4]["loss"] < steps[1]["loss"]
    logs = Path(full_cfg.logging.log_dir)
    lines = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert lines == full and (logs / "dpo.png").stat().st_size > 0
    assert any((logs / "tensorboard").iterdir())

    cfg = tiny_dpo_config(folder, ["trainer.default_local_dir=" + os.path.join(folder, "resumed")])
    first, second = run_distributed(_interrupted_then_resumed, cfg, world_size=2, timeout_s=600)[0]
    assert sorted(_train(first)) == [1, 2, 3] and sorted(_train(second)) == [3, 4]
    for step in (3, 4):  # the data position, weights, optimizer and LR schedule all came back
        for key in (*TRL_NAMES, "grad_norm"):
            assert _train(second)[step][key] == pytest.approx(steps[step][key], rel=1e-5, abs=1e-6), (
                step,
                key,
            )

    # The checkpoint is an ordinary training checkpoint: it converts to HF.
    from mcore_rl.cli import main

    root = Path(cfg.trainer.default_local_dir) / "checkpoints"
    assert (root / "latest").read_text().strip() == "global_step_4"
    out = Path(folder) / "hf"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(root / "global_step_4"), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and any(p.suffix == ".safetensors" for p in out.iterdir())
    assert (out / "tokenizer.json").read_bytes() == (
        Path(cfg.model.tokenizer_path) / "tokenizer.json"
    ).read_bytes()

    # Published whole, as an RL run's: its config and a manifest inside; a file altered since is named at
    # resume, before any weight is read.
    from mcore_rl.io.manifest import verify_manifest

    saved = root / "global_step_4"
    assert (saved / "config.yaml").is_file()
    verify_manifest(str(saved))
    shard = next(p for p in saved.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    more = tiny_dpo_config(
        folder,
        ["trainer.default_local_dir=" + os.path.join(folder, "resumed"), "trainer.total_training_steps=5"],
    )
    with pytest.raises(Exception, match=rf"{shard.name}"):
        run_distributed(_fit, more, world_size=2, timeout_s=600)


def _first_step(cfg: RunConfig) -> dict[str, Any] | None:
    records = _fit(cfg)  # rank 0 keeps the records; the others return None
    return _train(records)[1] if records else None


def test_precomputed_reference_equals_the_frozen_model(run_distributed, folder: str) -> None:
    common = [
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "dpo.test_freq=-1",
        "data.test_files=[]",
    ]
    frozen = tiny_dpo_config(folder, [*common, f"trainer.default_local_dir={folder}/frozen"])
    cached = tiny_dpo_config(
        folder, [*common, f"trainer.default_local_dir={folder}/cached", "dpo.precompute_ref_log_probs=true"]
    )
    a = run_distributed(_first_step, frozen, world_size=2, timeout_s=600)[0]
    b = run_distributed(_first_step, cached, world_size=2, timeout_s=600)[0]
    assert os.path.isfile(f"{folder}/cached/ref_log_probs_train.pt")
    for key in (*TRL_NAMES, "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    # Another initial model (seed 2) in the same run folder misses the cache: its reference is itself.
    reseeded = [*common, "trainer.seed=2"]
    frozen2 = tiny_dpo_config(folder, [*reseeded, f"trainer.default_local_dir={folder}/frozen2"])
    cached2 = tiny_dpo_config(
        folder,
        [
            *reseeded,
            f"trainer.default_local_dir={folder}/cached",
            f"logging.log_dir={folder}/cached2_logs",
            "dpo.precompute_ref_log_probs=true",
        ],
    )
    c = run_distributed(_first_step, frozen2, world_size=2, timeout_s=600)[0]
    d = run_distributed(_first_step, cached2, world_size=2, timeout_s=600)[0]
    assert c["logps/chosen"] != pytest.approx(a["logps/chosen"], rel=1e-3)  # the seed changed the model
    for key in (*TRL_NAMES, "grad_norm"):
        assert d[key] == pytest.approx(c[key], rel=1e-5, abs=1e-6), key


def test_reference_identity_follows_the_initial_model(tmp_path: Path) -> None:
    from mcore_rl.dpo.trainer import reference_identity

    def identity(overrides: list[str]) -> str:
        return reference_identity(tiny_dpo_config(str(tmp_path), overrides))

    assert identity([]) == identity([]) != identity(["trainer.seed=2"])
    assert identity([]) != identity(["model.dtype=bfloat16"])
    model = tmp_path / "model"
    model.mkdir()
    from_folder = tiny_dpo_config(str(tmp_path))
    from_folder.model.path = str(model)  # the identity reads the folder's files, not what they hold
    (model / "model.safetensors").write_bytes(b"a" * 8)
    first = reference_identity(from_folder)
    assert first != identity([])
    (model / "model.safetensors").write_bytes(b"b" * 9)  # the folder's weights replaced
    assert reference_identity(from_folder) != first


def test_recipe_without_pairs_is_refused(tmp_path: Path) -> None:
    from mcore_rl.dpo.trainer import DPOTrainer

    with pytest.raises(ConfigError, match=r"dpo\.train_files is empty"):
        DPOTrainer.from_config("recipes/demo_cpu.yaml", [f"trainer.default_local_dir={tmp_path}"])


def test_bad_dpo_keys_are_named() -> None:
    from mcore_rl.config import load_config

    with pytest.raises(ConfigError, match=r"dpo\.loss_type='kto' is not allowed"):
        load_config("recipes/dpo_demo_cpu.yaml", ["dpo.loss_type=kto"])
    with pytest.raises(
        ConfigError, match=r"dpo\.label_smoothing=0\.1 applies to loss_type sigmoid and robust"
    ):
        load_config("recipes/dpo_demo_cpu.yaml", ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match=r"dpo\.micro_batch_size_per_gpu=24 does not divide the 64 pairs"):
        load_config("recipes/dpo_demo_cpu.yaml", ["dpo.micro_batch_size_per_gpu=24"])
    with pytest.raises(ConfigError, match=r"dpo\.beta=0\.0 must be > 0"):
        load_config("recipes/dpo_demo_cpu.yaml", ["dpo.beta=0"])


@pytest.mark.slow  # two fresh processes (~10 s of imports each)
def test_cli_spawns_the_ranks_of_a_recipe(folder: str, tmp_path: Path, capsys) -> None:
    """``mcore-rl dpo`` on a 2-rank recipe from a plain process: it spawns both ranks and prints the summary."""
    from mcore_rl.cli import main
    from mcore_rl.config import save_config

    run = tmp_path / "cli_run"
    cfg = tiny_dpo_config(
        folder, [f"trainer.default_local_dir={run}", "trainer.total_training_steps=2", "trainer.save_freq=-1"]
    )
    recipe = save_config(cfg, tmp_path / "recipe")
    assert main(["dpo", str(recipe), "dpo.test_freq=-1"]) == 0
    out = capsys.readouterr().out
    assert "held-out preference accuracy (policy prefers chosen):" in out and "after 2 steps" in out
    assert "held-out greedy accuracy (exact_match scorer):" in out  # the demo rows' scorer, by name
    records = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in records] == [
        ("eval", 0),
        ("train", 1),
        ("train", 2),
        ("eval", 2),
    ]


def _build(cfg: RunConfig) -> None:
    from mcore_rl.dpo.trainer import DPOTrainer

    DPOTrainer.from_config(cfg).close()


def test_batch_larger_than_the_data_is_named(run_distributed, folder: str) -> None:
    from tests.distributed import DistributedTestError

    cfg = tiny_dpo_config(folder, [f"trainer.default_local_dir={folder}/big", "dpo.train_batch_size=128"])
    with pytest.raises(
        DistributedTestError, match=r"dpo\.train_batch_size=128: more than the 64 usable pairs"
    ):
        run_distributed(_build, cfg, world_size=2, timeout_s=300)


def _run_again(cfg: RunConfig, recipe: str) -> dict[str, Any]:
    """The finished run run again, as a trainer and as ``mcore-rl dpo``: its summary, whether it built a model,
    and the command's exit code and output."""
    import contextlib
    import io

    from mcore_rl.cli import main
    from mcore_rl.dpo.trainer import DPOTrainer

    with DPOTrainer.from_config(cfg) as trainer:
        summary = trainer.fit()
        built = getattr(trainer, "_policy", vars(trainer).get("policy")) is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["dpo", recipe])
    return {"summary": summary, "built": built, "code": code, "out": out.getvalue()}


def test_a_finished_run_run_again_is_complete(run_distributed, folder: str, tmp_path: Path) -> None:
    """As an RL run: it says so and exits 0, building no model and loading, evaluating, logging, exporting and
    plotting nothing."""
    from mcore_rl.config import save_config

    run = tmp_path / "run"
    overrides = ["trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.save_freq=1"]
    cfg = tiny_dpo_config(
        folder,
        [*overrides, "dpo.train_batch_size=8", "data.test_files=[]", f"trainer.default_local_dir={run}"],
    )
    run_distributed(_fit, cfg, world_size=1, timeout_s=600)
    written = ["logs/metrics.jsonl", "logs/dpo.png", "model/model.safetensors", "config.yaml"]
    before = {name: (run / name).stat().st_mtime_ns for name in written}
    recipe = str(save_config(cfg, tmp_path / "recipe"))
    again = run_distributed(_run_again, cfg, recipe, world_size=1, timeout_s=600)[0]
    checkpoint = run / "checkpoints" / "global_step_1"
    assert again["summary"] == {"already_complete": 1, "checkpoint": str(checkpoint)}
    assert not again["built"]
    assert again["code"] == 0
    assert f"already complete at step 1 ({checkpoint}); nothing to train" in again["out"]
    assert {name: (run / name).stat().st_mtime_ns for name in written} == before
