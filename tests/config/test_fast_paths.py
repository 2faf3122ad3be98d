"""The exact fast paths are on by default wherever they hold (``config/fast_paths.py``): rows packed
(``model.use_remove_padding``) and each prompt once per group (``model.share_prompt_prefix``) left at auto turn
on for a dense model at pipeline size 1 on the CPU, and off, named with what keeps them off, elsewhere; a value
set by the user is kept. The run logs them in one line with the on-policy shortcut's decision."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from mcore_rl.config import RunConfig, check_config, schema_node
from mcore_rl.config.fast_paths import describe_fast_paths, resolve_fast_paths
from mcore_rl.trainer.run_notes import fast_path_note
from tests.models import tiny_hf_config


def _cfg(family: str = "llama", *overrides: str) -> RunConfig:
    node = OmegaConf.merge(schema_node(), {"model": {"hf_config": tiny_hf_config(family)}})
    base = ["data.train_files=[unused.parquet]", "data.max_prompt_length=16", "data.max_response_length=16"]
    base.append("trainer.device=cpu")
    return check_config(OmegaConf.merge(node, OmegaConf.from_dotlist([*base, *overrides])))


def _on(cfg: RunConfig) -> tuple[bool | None, bool | None]:
    return cfg.model.use_remove_padding, cfg.model.share_prompt_prefix


def test_a_dense_model_on_the_cpu_packs_rows_and_shares_prompts_by_default() -> None:
    assert RunConfig().model.use_remove_padding is None  # auto until resolved
    cfg = _cfg()
    assert _on(cfg) == (True, True)
    note = fast_path_note(cfg)
    assert "model.use_remove_padding=true" in note and "model.share_prompt_prefix=true" in note
    assert "the old-log-prob pass skipped" in note
    assert "host memory: freed blocks of 1 MiB and up kept for reuse" in note  # engine/workers/host_heap.py


@pytest.mark.parametrize(
    ("family", "overrides", "expected", "reason"),
    [
        (
            "llama",
            ["parallel.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
            (False, False),
            "pipeline_model_parallel_size=2",
        ),
        ("mistral", [], (False, False), "sliding window"),
        ("qwen3_moe", [], (False, False), "mixture-of-experts"),
        (
            "llama",
            ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
            (True, False),
            "rollout.n=1",
        ),
        (
            "llama",
            ["parallel.context_parallel_size=2", "trainer.n_gpus_per_node=2"],
            (True, False),
            "context_parallel_size=2",
        ),
        ("llama", ["model.use_remove_padding=false"], (False, False), "model.use_remove_padding=false"),
        ("llama", ["model.lora_rank=4", "model.lora_dropout=0.1"], (True, False), "one mask for its group"),
    ],
    ids=["pp2", "window", "moe", "n1", "cp2", "padded-on-purpose", "lora-dropout"],
)
def test_auto_turns_a_path_off_naming_what_keeps_it_off(family, overrides, expected, reason) -> None:
    cfg = _cfg(family, *overrides)
    assert _on(cfg) == expected
    off = [line for line in describe_fast_paths(cfg) if "=false" in line]
    assert off and all(reason in line for line in off if "share_prompt_prefix" in line)


def test_a_gpu_keeps_the_padded_path_until_transformer_engine_packing_is_verified() -> None:
    cpu = _cfg("llama", "model.use_remove_padding=null", "model.share_prompt_prefix=null")
    unresolved = dataclasses.replace(cpu.model, use_remove_padding=None, share_prompt_prefix=None)
    gpu = dataclasses.replace(cpu, model=unresolved, trainer=dataclasses.replace(cpu.trainer, device="cuda"))
    resolved = resolve_fast_paths(gpu)
    assert _on(resolved) == (False, False)
    lines = describe_fast_paths(resolved)
    assert [line.split(" (")[0] for line in lines] == [  # one line per key, each off
        "model.use_remove_padding=false",
        "model.share_prompt_prefix=false",
    ]
    assert all("Transformer Engine" in line for line in lines)


def test_a_value_the_user_set_is_kept() -> None:
    assert _on(_cfg("llama", "model.share_prompt_prefix=false")) == (True, False)
    assert _on(_cfg("llama", "model.use_remove_padding=true", "model.share_prompt_prefix=false")) == (
        True,
        False,
    )
    with pytest.raises(
        Exception, match="pipeline_model_parallel_size=1"
    ):  # true where it cannot run: refused
        _cfg(
            "llama",
            "model.share_prompt_prefix=true",
            "parallel.pipeline_model_parallel_size=2",
            "trainer.n_gpus_per_node=2",
        )


def test_the_note_says_why_the_old_log_prob_pass_runs() -> None:
    assert "ppo_epochs" in fast_path_note(_cfg("llama", "algorithm.ppo_epochs=2"))
    assert "one_step_off" in fast_path_note(_cfg("llama", "trainer.one_step_off=true"))
    assert "recompute_old_log_probs" not in fast_path_note(_cfg("llama", "algorithm.adv_estimator=gae"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.n_gpus_per_node=2"], "prompt groups dealt to the 2 ranks by tokens"),
        (["trainer.n_gpus_per_node=1"], "one data-parallel rank: nothing to balance"),
        (["trainer.n_gpus_per_node=2", "trainer.balance_batch=false"], "trainer.balance_batch=false"),
        # mini-batches of 3 prompts x 4 samples over 2 ranks: 6 rows each, a group and a half
        (
            [
                "trainer.n_gpus_per_node=2",
                "data.train_batch_size=6",
                "algorithm.ppo_mini_batch_size=3",
                "algorithm.ppo_micro_batch_size_per_gpu=3",
            ],
            "a rank's share of a mini-batch (6 rows) is not whole groups of rollout.n=4",
        ),
    ],
)
def test_the_note_says_where_prompt_groups_are_balanced(overrides: list[str], expected: str) -> None:
    assert expected in fast_path_note(_cfg("llama", "rollout.n=4", "data.train_batch_size=8", *overrides))
    budget = _cfg("llama", "rollout.n=4", "algorithm.ppo_max_token_len_per_gpu=64", *overrides)
    assert "balance_batch" not in fast_path_note(budget)  # the token budget balances rows one by one


def test_the_lm_head_keeps_logits_for_its_backward_on_a_cpu_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.keep_logits_gib``: null keeps 1/16 of the host's memory over its ranks on a CPU (the backward
    then skips those logits' GEMM), none on a GPU or with the host cache off; a value is taken as given and
    reaches the actor's spec; a negative one is refused naming the key."""
    import mcore_rl.engine.lm_head as lm_head
    from mcore_rl.config import ConfigError
    from mcore_rl.trainer.build import worker_spec

    monkeypatch.setattr(lm_head, "host_memory_limit", lambda: 32 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert lm_head.keep_logits_bytes(None, torch.device("cpu"), 2) == 1 << 30
    assert lm_head.keep_logits_bytes(None, torch.device("cuda"), 2) == 0
    assert lm_head.keep_logits_bytes(123, torch.device("cuda"), 2) == 123
    assert worker_spec(_cfg(), total_optimizer_steps=1).keep_logits_bytes is None
    assert "of a micro-batch's logits kept for the backward (1/16 of memory" in fast_path_note(_cfg())
    cfg = _cfg("llama", "model.keep_logits_gib=0.5")
    assert worker_spec(cfg, total_optimizer_steps=1).keep_logits_bytes == 1 << 29
    assert "every logit recomputed" in fast_path_note(_cfg("llama", "model.keep_logits_gib=0"))
    no_cache = _cfg("llama", "trainer.host_cache_gib=0")  # a kept block would be faulted in every step
    assert worker_spec(no_cache, total_optimizer_steps=1).keep_logits_bytes == 0
    assert "(trainer.host_cache_gib=0" in fast_path_note(no_cache)
    with pytest.raises(ConfigError, match=r"model\.keep_logits_gib"):
        _cfg("llama", "model.keep_logits_gib=-1")
