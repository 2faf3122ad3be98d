"""DPO with LoRA at DP2: the reference is the base with the adapters off (no copy), so the first evaluation
ties every pair and training moves the policy away from it; the run checkpoint holds the adapters alone, and
the run ends with the merged ``model/`` and ``lora_adapter/`` (PEFT) whose tensors are the policy's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from mcore_rl.config import RunConfig
from mcore_rl.engine.hf.peft import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE
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
