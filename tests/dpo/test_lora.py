"""DPO with LoRA at DP2: the reference is the base with the adapters off (no copy), so the first evaluation
ties every pair and training moves the policy away from it; the run checkpoint holds the adapters alone, and
the run ends with the merged ``model/`` and ``lora_adapter/`` (PEFT) whose tensors are the policy's.
``model.lora_adapter_path`` loads the adapter into the policy, and its reference log-probs are the loaded
policy's (precomputed: the base with the adapters off would be another model)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from mcore_rl.config import RunConfig
from mcore_rl.engine.hf.peft import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, adapter_shapes, write_peft_adapter
from tests.dpo.test_trainer import tiny_dpo_config

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "trainer.total_training_steps=2", "dpo.test_freq=2"]


def _fit(cfg: RunConfig) -> dict[str, Any] | None:
    from mcore_rl.dpo.trainer import DPOTrainer
    from mcore_rl.engine.lora import gather_adapter_state

    with DPOTrainer.from_config(cfg) as trainer:
        trainer.fit()
        engine = trainer.policy.engine
        adapters = gather_adapter_state(engine.chunks, engine.arch, engine.ctx)
        view = trainer.policy.reference.chunks is engine.chunks
        return {"records": trainer.records, "adapters": adapters, "view": view} if trainer.records else None


def test_dpo_with_lora(run_distributed, tmp_path) -> None:
    cfg = tiny_dpo_config(str(tmp_path), LORA)
    out = run_distributed(_fit, cfg, world_size=2, timeout_s=600)[0]
    assert out["view"]  # the reference runs on the policy's own weights, adapters off
    evals = [r for r in out["records"] if r["stage"] == "eval"]
    train = {r["step"]: r for r in out["records"] if r["stage"] == "train"}
    assert evals[0]["eval_rewards/accuracies"] == 0.0  # B = 0: the policy is the reference
    assert train[1]["rewards/margins"] == 0.0 and train[2]["rewards/margins"] != 0.0

    run = cfg.trainer.default_local_dir
    stored = FileSystemReader(os.path.join(run, "checkpoints", "global_step_2")).read_metadata()
    weights = [
        k for k in stored.state_dict_metadata if k.endswith("weight") and not k.startswith("optimizer")
    ]
    assert weights and all(".lora_" in k for k in weights)
    assert os.path.isfile(os.path.join(run, "model", "config.json"))
    config = json.loads(Path(run, ADAPTER_DIR, CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    tensors = load_file(os.path.join(run, ADAPTER_DIR, WEIGHTS_FILE))
    assert len(tensors) == len(out["adapters"]) == 2 * 7 * cfg.model.arch().num_layers


def _adapter_folder(cfg: RunConfig, folder: str) -> dict[str, torch.Tensor]:
    """A PEFT folder of the run's adapters with B != 0 (a policy other than the base); returns its tensors."""
    spec, generator = cfg.model.lora_spec(), torch.Generator().manual_seed(0)
    assert spec is not None
    shapes = adapter_shapes(spec, cfg.model.arch())
    adapters = {k: 0.1 * torch.randn(s, generator=generator) for k, s in shapes.items()}
    os.makedirs(folder)
    write_peft_adapter(folder, spec, adapters, None)
    return adapters


def _fit_from_adapter(cfg: RunConfig) -> dict[str, Any]:
    from mcore_rl.dpo.trainer import DPOTrainer
    from mcore_rl.engine.lora import gather_adapter_state

    with DPOTrainer.from_config(cfg) as trainer:
        engine = trainer.policy.engine
        loaded = gather_adapter_state(engine.chunks, engine.arch, engine.ctx)
        trainer.fit()
        return {"loaded": loaded, "records": trainer.records}


def test_dpo_starts_from_lora_adapter_path(run_distributed, tmp_path) -> None:
    # The policy started from B = 0 adapters: model.lora_adapter_path was checked, never loaded.
    adapter = str(tmp_path / "adapter")
    overrides = [*LORA, "trainer.total_training_steps=1", "trainer.n_gpus_per_node=1"]
    adapters = _adapter_folder(tiny_dpo_config(str(tmp_path), overrides), adapter)
    cfg = tiny_dpo_config(
        str(tmp_path), [*overrides, f"model.lora_adapter_path={adapter}", "dpo.precompute_ref_log_probs=true"]
    )
    out = run_distributed(_fit_from_adapter, cfg, world_size=1, timeout_s=600)[0]
    assert out["loaded"].keys() == adapters.keys()
    assert all(torch.equal(out["loaded"][k], v) for k, v in adapters.items())
    train = next(r for r in out["records"] if r["stage"] == "train")
    assert train["rewards/margins"] == 0.0  # the reference is the policy as loaded, adapter included


def test_a_loaded_adapter_has_no_reference_model(tmp_path) -> None:
    from mcore_rl.dpo.trainer import policy_spec

    adapter = str(tmp_path / "adapter")
    cfg = tiny_dpo_config(
        str(tmp_path), [*LORA, f"model.lora_adapter_path={adapter}", "dpo.precompute_ref_log_probs=true"]
    )
    spec = policy_spec(cfg, 2, 0)
    assert spec.lora_adapter_path == adapter and not spec.with_reference
    with pytest.raises(ValueError, match=r"model\.lora_adapter_path=.*dpo\.precompute_ref_log_probs=true"):
        dataclasses.replace(spec, with_reference=True)  # the base without the adapter: not DPO's start


def test_cached_reference_log_probs_follow_the_loaded_adapter(tmp_path) -> None:
    # The cache was keyed by model.path alone: another adapter reused the first one's reference log-probs.
    from mcore_rl.dpo.trainer import reference_identity

    adapter = str(tmp_path / "adapter")
    bare = tiny_dpo_config(str(tmp_path), LORA)
    _adapter_folder(bare, adapter)
    cfg = tiny_dpo_config(
        str(tmp_path), [*LORA, f"model.lora_adapter_path={adapter}", "dpo.precompute_ref_log_probs=true"]
    )
    first = reference_identity(cfg)
    assert first != reference_identity(bare)
    weights = os.path.join(adapter, WEIGHTS_FILE)
    save_file({k: v + 1 for k, v in load_file(weights).items()}, weights)
    os.utime(weights, ns=(1, 1))  # same size; the modification time tells the files apart
    assert reference_identity(cfg) != first
