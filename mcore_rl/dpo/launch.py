"""Running a DPO recipe: in this process (one rank, or a rank that torchrun started), or by spawning the
recipe's ``trainer.nnodes * trainer.n_gpus_per_node`` local ranks (CPU runs and single-node tries).

    summary = run_dpo("recipes/dpo_demo_cpu.yaml", ["trainer.total_training_steps=100"])
"""

from __future__ import annotations

import os
import queue
from collections.abc import Sequence
from typing import Any

from mcore_rl.config import ConfigError, RunConfig, load_config


def run_rank(cfg: RunConfig) -> dict[str, Any]:
    """This process's rank of the run: build, fit, close; the summary (rank 0's logs are the record)."""
    from mcore_rl.dpo.trainer import DPOTrainer

    with DPOTrainer.from_config(cfg) as trainer:
        summary = trainer.fit()
        summary["steps"] = trainer.global_step
        summary["log_dir"] = cfg.logging.log_dir
    return summary


def run_dpo(recipe: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The whole run; returns rank 0's summary (``before`` / ``after`` evaluations, ``plot``, ``steps``)."""
    cfg = recipe if isinstance(recipe, RunConfig) else load_config(recipe, overrides)
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and int(launched) > 1:
        if int(launched) != cfg.world_size:
            raise ConfigError(
                f"the launcher started {launched} ranks but trainer.nnodes * trainer.n_gpus_per_node = "
                f"{cfg.world_size}"
            )
        return run_rank(cfg)
    if cfg.world_size == 1:
        return run_rank(cfg)
    return _spawn(cfg)


def _spawn(cfg: RunConfig) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from mcore_rl.parallel.launch_env import free_local_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_local_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, cfg.world_size, port, cfg, results))
        for rank in range(cfg.world_size)
    ]
    for p in procs:
        p.start()
    summary: dict[str, Any] | None = None
    while summary is None and all(p.exitcode in (None, 0) for p in procs):
        try:
            summary = results.get(timeout=1.0)
        except queue.Empty:
            if all(p.exitcode == 0 for p in procs):
                break
    for p in procs:
        p.join(timeout=None if summary is not None else 10)
    failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed or summary is None:
        raise RuntimeError(f"DPO ranks failed (rank, exit code): {failed or 'rank 0 returned nothing'}")
    return summary


def _rank_main(rank: int, world_size: int, port: int, cfg: RunConfig, results: Any) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if not torch.cuda.is_available():  # ranks share the CPU cores; oversubscription slows every rank
        torch.set_num_threads(max(1, (cfg.trainer.num_cpus or os.cpu_count() or 1) // world_size))
    summary = run_rank(cfg)
    if rank == 0:
        results.put(summary)
