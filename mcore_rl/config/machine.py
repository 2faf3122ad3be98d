"""``trainer.n_gpus_per_node: null``: the ranks per node this machine gives the run, as torchrun's
``--nproc-per-node=auto`` does: the ranks torchrun started (``LOCAL_WORLD_SIZE``) when it launched this
process, else every GPU, else on CPU one single-threaded rank per vCPU (``trainer.num_cpus``, else the job's
CPUs), then as many of those as the run's layout and batch sizes allow (:func:`world_size_problems`) and, on
CPU, as the host's memory holds.

Why one rank per vCPU on CPU: a rank whose threads span two vCPUs meets them at every op of its decode, and
what that costs moves with where the host places the vCPUs (``bench/bench_machine_modes.py``): one rank on
both vCPUs of these VMs ran the realistic workload 9.5% apart over twelve fresh runs, two single-threaded
ranks 3.8%, no slower (``bench/RESULTS.md``). Each rank holds a whole copy of the model's training state on
CPU, so the count stays where ``MEMORY_SHARE`` of the host's memory holds that state; activations, the KV
cache and the host cache take the rest.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from mcore_rl.config.fast_paths import compute_device
from mcore_rl.config.validate import world_size_problems
from mcore_rl.engine.params import model_params
from mcore_rl.io.errors import ConfigError
from mcore_rl.io.host import available_cpus, host_memory_limit

if TYPE_CHECKING:
    from mcore_rl.config.run import RunConfig

MEMORY_SHARE = 2
"""Ranks of a CPU run hold their training state in at most 1 / this of the host's memory."""


def node_devices(cfg: RunConfig, device: str) -> int:
    """How many ranks a node could run on ``device`` (cuda, cpu): torchrun's ranks, the GPUs, or the vCPUs."""
    launched = os.environ.get("LOCAL_WORLD_SIZE")
    if launched and launched.isdigit() and int(launched) > 0:
        return int(launched)
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return cfg.trainer.num_cpus or available_cpus()


def resolve_ranks_per_node(cfg: RunConfig, max_ranks: int | None = None) -> RunConfig:
    """``cfg`` with ``trainer.n_gpus_per_node`` set: as given, or (null) the most ranks up to the node's devices,
    ``max_ranks`` (an in-process run: 1) and, on CPU, the host's memory, that the world-size rules accept. When
    no count passes them, the devices' count is kept, so that the error the rules then give names it."""
    if cfg.trainer.n_gpus_per_node is not None:
        return cfg
    device = compute_device(cfg)
    devices = max(1, node_devices(cfg, device) - ranks_beside_actor(cfg))
    limit = min(devices, max_ranks or devices)
    if device == "cpu":
        limit = max(1, min(limit, _ranks_in_memory(cfg)))
    for ranks in range(limit, 0, -1):
        candidate = _with_ranks(cfg, ranks)
        if not world_size_problems(candidate):
            return candidate
    return _with_ranks(cfg, limit)


def ranks_beside_actor(cfg: RunConfig) -> int:
    """Ranks a PPO critic or a rollout pool of its own runs beside the actor's (``trainer/build.py`` shares
    the cluster's CPUs over all of them; an automatic actor count leaves them their devices)."""
    critic = cfg.critic.num_ranks if cfg.algorithm.adv_estimator == "gae" and not cfg.critic.colocate else 0
    return critic + (0 if cfg.rollout.colocate else cfg.rollout.num_ranks)


def _with_ranks(cfg: RunConfig, ranks: int) -> RunConfig:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, n_gpus_per_node=ranks))


def _ranks_in_memory(cfg: RunConfig) -> int:
    """CPU ranks whose training states fit ``1 / MEMORY_SHARE`` of the host (any count when the model's
    config cannot be read yet: the path checks name it later)."""
    try:
        arch = cfg.model.arch()
    except (ConfigError, OSError):
        return 1 << 30
    weight_bytes = 4 if cfg.model.dtype == "float32" else 2
    # the training weights and the rollout engine's copy; a full fine-tune adds fp32 grads and Adam's two
    # moments (and fp32 main weights under bf16); LoRA's frozen base has none of them
    per_param = 2 * weight_bytes + (0 if cfg.model.lora_rank else 12 + (4 if weight_bytes == 2 else 0))
    per_rank = model_params(arch) * per_param
    return max(1, host_memory_limit() // MEMORY_SHARE // per_rank)


def describe_cpu_layout(cfg: RunConfig) -> str:
    """The resolved CPU layout, for the run's start-up note."""
    ranks = cfg.trainer.n_gpus_per_node or 1
    threads = max(1, (cfg.trainer.num_cpus or available_cpus()) // ranks)
    sharded = cfg.optim.distributed_on("cpu")
    return (
        f"trainer.n_gpus_per_node={ranks} ({threads} thread{'s' * (threads > 1)} per rank); "
        f"optim.use_distributed_optimizer={str(sharded).lower()} "
        f"({'optimizer state sharded' if sharded else 'gradients all-reduced, through shared memory between the ranks of a host; no parameter all-gather'})"
    )
