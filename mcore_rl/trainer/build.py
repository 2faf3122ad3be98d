"""Building the actor group a run config describes: a Ray worker group (the default) or one in-process
rank (the overhead baseline and quick tests)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.algo.settings import AdvEstimator
from mcore_rl.config import ConfigError, RunConfig
from mcore_rl.config.fast_paths import keep_logits_setting
from mcore_rl.config.machine import ranks_beside_actor
from mcore_rl.config.model import RolloutEngineName, shipped_tokenizer
from mcore_rl.controller import RayConfig, ResourcePool, WorkerGroup, available_cpus, init_ray
from mcore_rl.controller.backend import Backend, InProcessBackend, RayBackend
from mcore_rl.controller.resources import cluster_cpus, ray_shut_down_on_failure
from mcore_rl.controller.watchdog import GRACE_S
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.engine.rollout.vllm_engine import VLLMRolloutConfig
from mcore_rl.engine.workers.actor import HybridWorker, WorkerSpec
from mcore_rl.engine.workers.critic import CriticSpec, CriticWorker
from mcore_rl.engine.workers.reward_model import RewardModelSpec, reward_model_arch
from mcore_rl.engine.workers.rollout import RolloutSpec, RolloutWorker
from mcore_rl.io.side_files import TOKENIZER_FILES
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.launch_env import free_local_port
from mcore_rl.scoring import RewardScorer
from mcore_rl.scoring.registry import check_scorers, row_problem
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.trainer.groups.critic import CriticGroup
from mcore_rl.trainer.groups.reward_model import RewardModelGroup, reward_model_checkpoint
from mcore_rl.trainer.groups.rollout import RolloutGroup
from mcore_rl.trainer.grpo import GRPOStep
from mcore_rl.trainer.multi_turn import check_multi_turn
from mcore_rl.trainer.ppo import PPOStep
from mcore_rl.trainer.rollout_source import ColocatedRollout, PoolRollout, RolloutSource
from mcore_rl.trainer.step import StepBase, update_plan


def check_start(cfg: RunConfig, tokenizer: Tokenizer, data_sources: dict[str, str]) -> None:
    """What refuses a run before anything is written or started, beyond the config's own rules: a tokenizer
    with ids the model has no embedding for, a ``data_source`` with no scorer (``data_sources``: each one of
    the training, validation and test data -> where a row of it is), tools or a chat template a multi-turn
    rollout cannot use."""
    check_vocab(cfg, tokenizer)
    cfg.model.generation_stop_ids()  # a broken generation_config.json named before any worker starts
    check_reward_model_tokens(cfg, tokenizer)
    check_scorers(cfg.reward, data_sources)
    check_multi_turn(cfg, tokenizer)


def check_reward_model_tokens(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """The reward model reads the policy's token ids as they are: its vocabulary must cover them, and where its
    folder has a tokenizer, it must be the policy's (verl re-tokenizes for a different one; a different one
    here scored ids that meant other text, or read unloaded embedding padding rows, in silence)."""
    path = cfg.reward_model.path
    if path is None:
        return
    vocab_size = reward_model_arch(path).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"reward_model.path {path}: its vocab_size={vocab_size} is smaller than the policy's tokenizer "
            f"({tokenizer.vocab_size} tokens); the reward model must share the policy's tokenizer"
        )
    folder = shipped_tokenizer(path)
    if folder is None or _same_tokenizer_files(folder, cfg.model.tokenizer_path):
        return
    if _token_table(load_tokenizer(folder)) != _token_table(tokenizer):
        raise ConfigError(
            f"reward_model.path {path}: its tokenizer ({folder}) differs from the policy's "
            f"(model.tokenizer_path {cfg.model.tokenizer_path}); the reward model reads the policy's "
            "token ids, so it must share its tokenizer (re-tokenizing for it is not supported)"
        )


def _same_tokenizer_files(folder: str, other: str | None) -> bool:
    """Both folders hold the same tokenizer files, byte for byte (the usual case: a reward model trained from
    the policy's base): the same ids without decoding every id of both (about 1 s at Qwen's 151k)."""
    import filecmp

    if other is None or not os.path.isdir(other):
        return False
    for name in TOKENIZER_FILES:
        mine, theirs = os.path.join(folder, name), os.path.join(other, name)
        if os.path.isfile(mine) != os.path.isfile(theirs):
            return False
        if os.path.isfile(mine) and not filecmp.cmp(mine, theirs, shallow=False):
            return False
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model"))


def _token_table(tokenizer: Tokenizer) -> list[str]:
    """Each id's text: two tokenizers with equal tables give the same ids the same meaning."""
    return [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)]


def row_checks(cfg: RunConfig) -> Callable[[str, Any, dict[str, Any]], tuple[str, str] | None]:
    """What a prompt row must hold for its scorer, checked as the data is read (the row is refused, or skipped
    and counted with ``data.skip_bad_rows``): a ground truth the built-in rules can compare as text (a dict
    scored every answer 0 before), the format scorer's pattern (``scoring.registry.row_problem``)."""
    return functools.partial(row_problem, cfg.reward)


def check_vocab(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """A tokenizer larger than the model's vocabulary would hand it ids past its embedding (found by a run that
    died mid-way on the first prompt with such an id); a smaller one is fine (HF models pad theirs)."""
    vocab_size = cfg.model.arch().vocab_size
    if tokenizer.vocab_size > vocab_size:
        where = (
            "model.hf_config vocab_size"
            if "vocab_size" in cfg.model.hf_config
            else f"{cfg.model.path}/config.json vocab_size"
        )
        raise ConfigError(
            f"model.tokenizer_path {cfg.model.tokenizer_path}: the tokenizer has {tokenizer.vocab_size} tokens, "
            f"more than the model's {where}={vocab_size}; use the model's own tokenizer, or a model whose "
            "vocab_size covers it"
        )


def router_aux_loss_weight(cfg: RunConfig) -> float:
    """``model.moe_aux_loss_coeff``, or the checkpoint's own coefficient (HF ``router_aux_loss_coef``)."""
    if cfg.model.moe_aux_loss_coeff is not None:
        return cfg.model.moe_aux_loss_coeff
    moe = cfg.model.arch().moe
    return moe.router_aux_loss_coef if moe is not None else 0.0


def worker_spec(cfg: RunConfig, total_optimizer_steps: int, load_dir: str | None = None) -> WorkerSpec:
    """What every rank builds, from the run config (checked by ``config.validate``)."""
    megatron = cfg.model.is_megatron_checkpoint()
    arch = cfg.model.arch()
    aux = router_aux_loss_weight(cfg)
    return WorkerSpec(
        arch=arch,
        optim=cfg.optim,
        total_optimizer_steps=total_optimizer_steps,
        dtype=cfg.model.dtype,
        scaled_output_init=cfg.model.scaled_output_init,
        keep_logits_bytes=keep_logits_setting(cfg),
        remove_padding=bool(cfg.model.use_remove_padding),
        share_prompt_prefix=bool(cfg.model.share_prompt_prefix),
        # rollout.tensor_model_parallel_size is the pool's when the rollout has a pool of its own
        rollout_tp=cfg.rollout.tensor_model_parallel_size if cfg.rollout.colocate else 1,
        hybrid=cfg.rollout.hybrid,
        with_reference=cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        load_dir=load_dir or initial_checkpoint(cfg),
        hf_path=cfg.model.path if cfg.model.path and cfg.model.load_weights and not megatron else None,
        vllm=vllm_rollout_config(cfg) if cfg.rollout.colocate else None,
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=cfg.model.moe_z_loss_coeff,
        router_replay=cfg.actor.router_replay,
        lora=cfg.model.lora_spec(),
        lora_adapter_path=cfg.model.lora_adapter_path,
        recompute=cfg.model.recompute,
    )


def initial_checkpoint(cfg: RunConfig) -> str | None:
    """``model.path`` when it is a megatron model checkpoint whose weights the run loads (each rank reads its
    own shards, at any layout), else None (an HF folder is read whole: ``WorkerSpec.hf_path``)."""
    if cfg.model.path is None or not cfg.model.load_weights or not cfg.model.is_megatron_checkpoint():
        return None
    return cfg.model.path


def vllm_rollout_config(cfg: RunConfig) -> VLLMRolloutConfig | None:
    """vLLM's settings from the run config (``rollout.name=vllm``), None for the embedded engine. vLLM computes
    in the dtype the reshard hands it (``rollout.hybrid.rollout_dtype``, else the actor's), so an fp32 run
    samples in fp32."""
    if cfg.rollout.name != RolloutEngineName.VLLM:
        return None
    return VLLMRolloutConfig(
        dtype=getattr(torch, cfg.rollout.hybrid.rollout_dtype or cfg.model.dtype),
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.response_length,
        kv_cache_memory_bytes=cfg.rollout.kv_cache_memory_bytes,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        record_routing=True if cfg.actor.router_replay else None,  # replay: refused where not recorded
    )


def critic_spec(cfg: RunConfig, total_optimizer_steps: int) -> CriticSpec:
    """What every critic rank builds: started from ``critic.model_path`` or the actor."""
    own_pp = (
        (cfg.critic.parallel or cfg.parallel).pipeline_model_parallel_size if not cfg.critic.colocate else 1
    )
    return CriticSpec(
        arch=cfg.model.arch(),
        optim=cfg.critic.optim,
        total_optimizer_steps=total_optimizer_steps,
        cliprange_value=cfg.critic.cliprange_value,
        dtype=cfg.model.dtype,
        hf_path=cfg.critic.model_path,
        # packing needs PP1: a pool of its own at PP > 1 keeps padded rows (auto packing followed the actor's)
        remove_padding=bool(cfg.model.use_remove_padding) and own_pp == 1,
        on_nonfinite=cfg.trainer.on_nonfinite_loss,
        moe_aux_loss_coeff=router_aux_loss_weight(cfg),  # a MoE critic's routers train as the actor's
        moe_z_loss_coeff=cfg.model.moe_z_loss_coeff,
        recompute=cfg.model.recompute,
    )


def build_critic_group(cfg: RunConfig, actors: ActorGroup, total_optimizer_steps: int) -> CriticGroup:
    """The critic on the actor's ranks (colocated), started from ``critic.model_path`` or the actor."""
    path = cfg.critic.model_path
    spec = critic_spec(cfg, total_optimizer_steps)
    if cfg.critic.colocate:
        critic = CriticGroup(actors.backend)
        critic.build(spec)
        return critic
    if not isinstance(actors.backend, RayBackend):
        raise ConfigError("critic.colocate=false: a critic on its own pool needs the Ray driver (use_ray)")
    group = _spawn_group(cfg, CriticWorker, cfg.critic.num_ranks, cfg.critic.parallel or cfg.parallel)
    try:
        group.infos = group.run("build", spec)
        critic = CriticGroup(RayBackend(group), actors=actors.backend)
        if path is None:
            critic.init_from_actor()
    except BaseException:
        group.shutdown()
        raise
    return critic


def build_rollout_group(cfg: RunConfig, actors: ActorGroup) -> RolloutGroup:
    """The rollout pool of ``rollout.colocate=false``: ``rollout.num_ranks`` ranks at rollout TP, holding the
    actor's current weights. The driver keeps the actors' weights flowing (``RolloutGroup.load_weights_from``
    after each update)."""
    if cfg.rollout.colocate:
        raise ConfigError("rollout.colocate=true: the rollout runs on the actor's ranks, there is no pool")
    if not isinstance(actors.backend, RayBackend):
        raise ConfigError("rollout.colocate=false: a rollout pool of its own needs the Ray driver (use_ray)")
    rollout = cfg.rollout
    spec = RolloutSpec(
        arch=cfg.model.arch(),
        weights_dtype=rollout.hybrid.rollout_dtype,  # the colocated reshard's cast, then a float32 engine
        vllm=vllm_rollout_config(cfg),
    )  # the default pad id, as the actor's WorkerSpec: pool and colocated rollouts pad alike
    group = _spawn_group(cfg, RolloutWorker, rollout.num_ranks, rollout_pool_parallel(cfg))
    try:
        group.infos = group.run("build", spec)
        rollouts = RolloutGroup(RayBackend(group))
        rollouts.load_weights_from(actors)
    except BaseException:
        group.shutdown()
        raise
    return rollouts


def rollout_pool_parallel(cfg: RunConfig) -> ParallelConfig:
    """A rollout pool's layout: ``rollout.num_ranks`` ranks in replicas of ``rollout.tensor_model_parallel_size``
    (its data-parallel ranks); none of the actor's pipeline, context or expert meshes, which would fold ranks
    into one replica (two ranks of a CP2 actor's pool both sampled replica 0)."""
    return dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=cfg.rollout.tensor_model_parallel_size,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=None,
        data_parallel_size=None,
    )


def _spawn_group(cfg: RunConfig, worker: type, ranks: int, parallel: ParallelConfig) -> WorkerGroup:
    """``ranks`` Ray workers of class ``worker`` on a placement group of their own (each rank its share of
    the cluster's CPUs, a GPU when the run uses them), console output to :func:`worker_output_dir`."""
    pool = ResourcePool(ranks, _cpus_per_rank(cfg), 1.0 if _use_gpus(cfg) else 0.0)
    group = WorkerGroup.spawn(
        worker,
        ranks,
        collectives_outlast_the_watchdog(parallel, cfg.trainer.phase_timeout_s),
        pool=pool,
        take_pool=True,
        seed=cfg.trainer.seed,
        output_dir=worker_output_dir(cfg),
        phase_timeout_s=cfg.trainer.phase_timeout_s,
        stacks_dir=os.path.join(cfg.logging.log_dir, STACKS_DIR),
    )
    try:  # the driver's fast-path note says what this does
        group.run("keep_freed_host_memory", cfg.trainer.host_cache_gib)
    except BaseException:
        group.shutdown()
        raise
    return group


STACKS_DIR = "stacks"
"""Under ``logging.log_dir``: each rank's Python stacks of a phase past ``trainer.phase_timeout_s``."""


def collectives_outlast_the_watchdog(
    parallel: ParallelConfig, phase_timeout_s: float | None
) -> ParallelConfig:
    """``parallel`` with its collective timeout (``timeout_minutes``) raised past ``trainer.phase_timeout_s``
    and the watchdog's grace when it is not already: a rank stuck in a collective is then named by the
    watchdog, with every rank's stack, instead of ending first in the process group's own timeout error."""
    if phase_timeout_s is None:
        return parallel
    minutes = math.ceil((phase_timeout_s + 2 * GRACE_S) / 60) + 1
    return (
        parallel
        if parallel.timeout_minutes >= minutes
        else dataclasses.replace(parallel, timeout_minutes=minutes)
    )


def _cpus_per_rank(cfg: RunConfig) -> float:
    """The cluster's CPUs shared evenly by every rank of the run: the actor's, a separate critic's and a
    separate rollout pool's (each rank's torch threads are its share, at least one)."""
    return cluster_cpus() / (cfg.world_size + ranks_beside_actor(cfg))


def worker_output_dir(cfg: RunConfig) -> str | None:
    """Where the workers' console output (warnings of megatron, vLLM and torch, one file per rank) goes:
    ``<logging.log_dir>/workers``, so the driver's console holds the progress bars and results; None (the
    driver's console, live) with ``mcore-rl --verbose`` (``MCORE_RL_VERBOSE=1``)."""
    if os.environ.get("MCORE_RL_VERBOSE", "") not in ("", "0"):
        return None
    return os.path.join(cfg.logging.log_dir, "workers")


def _use_gpus(cfg: RunConfig) -> bool:
    if cfg.trainer.device == "auto":
        return torch.cuda.is_available()
    return cfg.trainer.device == "cuda"


def build_actor_group(cfg: RunConfig, spec: WorkerSpec, use_ray: bool = True) -> ActorGroup:
    """Start the workers, build their engines, and sync the initial weights into the rollout engines."""
    parallel = cfg.parallel
    backend: Backend
    if use_ray:
        started_ray = init_ray(RayConfig(address=cfg.trainer.ray_address, num_cpus=cfg.trainer.num_cpus))
        with ray_shut_down_on_failure(started_ray):
            group = _spawn_group(cfg, HybridWorker, cfg.world_size, parallel)
            try:
                group.infos = group.run("build", spec)  # now with the rollout coordinates
            except BaseException:
                group.shutdown()
                raise
        backend = RayBackend(group, owns_ray=started_ray)
        # The driver now only schedules, scores and computes advantages. An OpenMP pool of its own would
        # spin after each of those small ops on the cores the ranks compute on (about 10 ms of CPU a step
        # measured on 2 cores), so its torch work runs on one thread.
        torch.set_num_threads(1)
    else:
        if cfg.world_size != 1:
            raise ValueError(
                f"in-process runs have one rank; trainer.n_gpus_per_node * nnodes = {cfg.world_size}"
            )
        worker = HybridWorker(0, 1, num_threads=cfg.trainer.num_cpus or available_cpus())
        worker.init_parallel("127.0.0.1", free_local_port(), parallel, cfg.trainer.seed)
        worker.keep_freed_host_memory(cfg.trainer.host_cache_gib)
        worker.build(spec)
        backend = InProcessBackend(worker)
    actors = ActorGroup(backend)
    actors.sync_weights()
    return actors


def build_step(
    cfg: RunConfig, actors: ActorGroup, tokenizer: Tokenizer, scorer: RewardScorer, total_steps: int
) -> StepBase:
    """The algorithm's step over ``actors``, with what the config adds beside them: PPO's critic (on the
    actor's ranks or its own pool), a reward model (forward-only on the actor's ranks), a rollout pool of its
    own (``rollout.colocate=false``, sent the weights after each update)."""
    critic = None
    if cfg.algorithm.adv_estimator == AdvEstimator.GAE:
        plan = update_plan(cfg)
        critic = build_critic_group(cfg, actors, total_steps * plan.num_mini_batches * plan.ppo_epochs)
    reward_model = None
    if cfg.reward_model.path is not None:
        path = reward_model_checkpoint(cfg.reward_model.path, cfg.trainer.default_local_dir)
        spec = RewardModelSpec(path, cfg.model.dtype, tokenizer.pad_token_id)
        reward_model = RewardModelGroup(actors.backend, spec)
    rollout: RolloutSource = ColocatedRollout(actors)
    if not cfg.rollout.colocate:
        rollout = PoolRollout(build_rollout_group(cfg, actors), actors)
    if critic is not None:
        return PPOStep(cfg, actors, critic, tokenizer, scorer, rollout=rollout, reward_model=reward_model)
    return GRPOStep(cfg, actors, tokenizer, scorer, rollout=rollout, reward_model=reward_model)
