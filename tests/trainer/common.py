"""A tiny run config over the demo's addition task (data written into a temp folder), for driver tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from mcore_rl.config import RunConfig, check_config, schema_node
from mcore_rl.data.demo_task import write_demo_dataset
from tests.models import tiny_hf_config


def tiny_run_config(folder: str, overrides: list[str] | None = None, family: str = "llama") -> RunConfig:
    """8 prompts x 4 samples per step on a 4-layer h64 Llama (or ``family``'s tiny test model) with the
    14-symbol tokenizer."""
    paths = {s: os.path.join(folder, f"{s}.jsonl") for s in ("train", "val", "test", "sft")}
    if not os.path.exists(paths["train"]):
        sizes = {"train": 64, "val": 16, "test": 16, "sft": 64}
        write_demo_dataset({**paths, "tokenizer": os.path.join(folder, "tokenizer")}, seed=1, sizes=sizes)
    hf: dict[str, Any] = tiny_hf_config(family, vocab_size=14, max_position_embeddings=32)
    base = [
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        f"model.tokenizer_path={os.path.join(folder, 'tokenizer')}",
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=6",
        "rollout.n=4",
        "algorithm.ppo_micro_batch_size_per_gpu=8",
        "optim.lr=1e-3",
        "optim.weight_decay=0.0",
        f"trainer.default_local_dir={os.path.join(folder, 'run')}",
        "trainer.num_cpus=2",
        "trainer.n_gpus_per_node=1",  # one rank, in process or on Ray; the tests of more ranks set theirs
        "trainer.val_before_train=false",  # the driver tests compare training steps; test_lifecycle.py sets it
    ]
    node = OmegaConf.merge(schema_node(), {"model": {"hf_config": hf}})
    node = OmegaConf.merge(node, OmegaConf.from_dotlist(base + list(overrides or [])))
    return check_config(node)


QUIET = ["trainer.save_freq=-1", "trainer.test_freq=-1", "logging.progress_bar=false", "logging.plot=false"]
"""No checkpoints, validation, progress bar or plot: a run that only trains and logs its steps."""


def rl_records(
    data: str, run_dir: object, overrides: list[str], inspect: Callable[[Any], None] | None = None
) -> list[dict]:
    """The RL steps' records of an in-process run of :func:`tiny_run_config` ``(data, overrides)`` writing into
    ``run_dir``; ``inspect(trainer)`` runs after ``fit`` (checks on the trainer itself)."""
    from mcore_rl.trainer.trainer import Trainer

    cfg = tiny_run_config(data, [*overrides, f"trainer.default_local_dir={run_dir}"])
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        trainer.fit()
        if inspect is not None:
            inspect(trainer)
        return [r for r in trainer.records if r["stage"] == "rl"]


def small_first_digit(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """A reward a random model earns about half the time, so GRPO groups have mixed rewards."""
    return float(solution_str[:1] in "01234")


MIXED_REWARD = f"reward.custom_function={os.path.abspath(__file__)}:small_first_digit"


def overflowing_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
    """Finite rewards whose advantages (unnormalised) overflow the fp32 loss: a NaN/inf loss, for real."""
    return 3e38 if solution_str[:1] in "01234" else 0.0


OVERFLOWING_REWARD = f"reward.custom_function={os.path.abspath(__file__)}:overflowing_reward"


def demo_recipe_overrides(data: str, run: str) -> list[str]:
    """``recipes/demo_cpu.yaml`` shrunk to the tiny data of :func:`tiny_run_config` (already written)."""
    return [
        "data.generate=null",
        f"data.train_files=[{data}/train.jsonl]",
        f"data.val_files=[{data}/val.jsonl]",
        f"data.test_files=[{data}/test.jsonl]",
        f"sft.train_files=[{data}/sft.jsonl]",
        f"model.tokenizer_path={data}/tokenizer",
        "model.hf_config.hidden_size=64",
        "model.hf_config.intermediate_size=96",
        "data.train_batch_size=4",
        "rollout.n=4",
        "algorithm.ppo_micro_batch_size_per_gpu=8",
        "logging.progress_bar=false",
        "logging.plot=false",
        f"trainer.default_local_dir={run}",
    ]


def built_worker(ctx: Any, spec: Any, initial: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """A ``HybridWorker`` on ``ctx`` (one per rank of its world) built from ``spec``, its weights set to
    ``initial``, or kept when None: -> (worker, the starting weights), so the runs a test compares all start
    from the first one's weights."""
    import torch

    from mcore_rl.engine.workers.actor import HybridWorker

    worker = HybridWorker(ctx.rank, ctx.layout.world_size, num_threads=1)
    worker._ctx = ctx
    worker.build(spec)
    params = dict(worker.engine.models[0].named_parameters())
    if initial is None:
        initial = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(initial[k])
    worker.engine.optimizer.reload_model_params()
    return worker, initial
