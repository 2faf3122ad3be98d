"""The ``dpo`` section: the recipes resolve, and every key survives a YAML round trip."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.config import CONFIG_FILE, load_config, save_config

CHANGES = [
    "dpo.loss_type=robust",
    "dpo.label_smoothing=0.2",
    "dpo.beta=0.3",
    "dpo.reference_free=true",
    "dpo.precompute_ref_log_probs=true",
    "dpo.sft_loss_weight=0.5",
    "dpo.max_length=20",
    "dpo.chosen_key=good",
    "dpo.rejected_key=bad",
    "dpo.test_freq=-1",
]


def test_dpo_section_round_trips(tmp_path: Path) -> None:
    cfg = load_config("recipes/dpo_demo_cpu.yaml", CHANGES)
    assert cfg.dpo != load_config("recipes/dpo_demo_cpu.yaml").dpo
    save_config(cfg, tmp_path)
    assert load_config(tmp_path / CONFIG_FILE) == cfg


def test_multi_rank_recipe_resolves() -> None:
    cfg = load_config("recipes/dpo_demo_cpu_tp2pp2.yaml")
    assert cfg.world_size == 4 and cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.dpo.train_files == load_config("recipes/dpo_demo_cpu.yaml").dpo.train_files


def test_the_policy_is_initialised_as_the_model_section_says() -> None:
    from mcore_rl.dpo.trainer import policy_spec

    for scaled in (True, False):
        cfg = load_config("recipes/dpo_demo_cpu.yaml", [f"model.scaled_output_init={str(scaled).lower()}"])
        assert policy_spec(cfg, total_steps=1, pad_token_id=0).scaled_output_init is scaled
