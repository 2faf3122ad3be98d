"""A run config (:class:`~mcore_rl.config.RunConfig`) as the planner's :class:`PlanInput`.

Which key feeds which planner field (the run config stays the one schema; the planner only reads it):

    trainer.nnodes * trainer.n_gpus_per_node    world_size (training and rollout colocated on all GPUs; a
                                                null count is this machine's, config/machine.py: set it to
                                                plan for a cluster's nodes)
    trainer.n_gpus_per_node                     gpus_per_node
    parallel.*                                  tp, pp, vpp, sp, ep (expert_model_parallel_size),
                                                etp (expert_tensor_parallel_size), cp (context_parallel_size)
    data.max_prompt_length + max_response_length  seq_length (the longest training sequence), rounded up to
                                                the layout's sequence multiple as the workers pad it
    algorithm.ppo_micro_batch_size_per_gpu      micro_batch_size
    algorithm.ppo_mini_batch_size * rollout.n   global_batch_size (sequences per optimizer step)
    model.dtype                                 bf16 (anything but float32 stores 2-byte weights)
    optim.use_distributed_optimizer             use_distributed_optimizer
    algorithm.use_kl_loss / use_kl_in_reward    reference (a frozen reference policy is colocated)
    model.lora_rank, model.target_modules       lora_rank, lora_targets (planner/lora.py)
    model.keep_logits_gib                       keep_logits_bytes (unset: 0, the GPU default)
    algorithm.adv_estimator == gae              critic (PPO: a value-head critic on the actor's GPUs)
    rollout.tensor_model_parallel_size          rollout_tp
    rollout.gpu_memory_utilization              rollout_memory_fraction
    rollout.hybrid.*                            offload_optimizer, offload_grad_buffers,
                                                reshard_inflight_bytes (max_inflight_bytes or 2 x bucket),
                                                rollout_dtype (None when it is model.dtype: no cast)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcore_rl.config.fast_paths import keep_logits_setting
from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.layout import LayoutError
from mcore_rl.planner.spec import LORA_ALL_LINEAR, PlanInput

if TYPE_CHECKING:
    from mcore_rl.config import RunConfig


def plan_input_from_config(cfg: RunConfig, arch: ModelArch | None = None, **planner: Any) -> PlanInput:
    """``planner`` sets what the run config does not say (gpu, recompute, flash_attention, critic, ...);
    ``arch`` replaces ``cfg.model.arch()`` when the model folder is not on this machine."""
    par, algo, rollout, hybrid = cfg.parallel, cfg.algorithm, cfg.rollout, cfg.rollout.hybrid
    return PlanInput(
        arch=arch or cfg.model.arch(),
        world_size=cfg.world_size,
        gpus_per_node=cfg.world_size // cfg.trainer.nnodes,  # resolved: load_config sets an automatic count
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        vpp=par.virtual_pipeline_model_parallel_size,
        sp=par.sequence_parallel,
        ep=par.expert_model_parallel_size,
        etp=par.expert_tensor_parallel_size,
        cp=par.context_parallel_size,
        seq_length=_padded(cfg.data.max_prompt_length + cfg.data.max_response_length, cfg),
        micro_batch_size=algo.ppo_micro_batch_size_per_gpu,
        global_batch_size=algo.ppo_mini_batch_size * rollout.n,
        bf16=cfg.model.dtype != "float32",
        use_distributed_optimizer=cfg.optim.distributed_on("cuda"),  # the planner sizes GPU runs
        reference=algo.use_kl_loss or algo.use_kl_in_reward,
        lora_rank=cfg.model.lora_rank,
        lora_targets=_lora_targets(cfg),
        keep_logits_bytes=keep_logits_setting(cfg) or 0,  # as the ranks take it; unset: none on a GPU
        rollout_tp=rollout.tensor_model_parallel_size,
        rollout_memory_fraction=rollout.gpu_memory_utilization,
        offload_optimizer=hybrid.offload_optimizer,
        offload_grad_buffers=hybrid.offload_grad_buffers,
        reshard_inflight_bytes=hybrid.max_inflight_bytes or 2 * hybrid.bucket_bytes,
        # the rollout runs in rollout_dtype or model.dtype (trainer/build.py); the same dtype is no cast
        rollout_dtype=hybrid.rollout_dtype if hybrid.rollout_dtype != cfg.model.dtype else None,
        **{"critic": algo.adv_estimator == "gae", "recompute": cfg.model.recompute, **planner},
    )


def _padded(seq_length: int, cfg: RunConfig) -> int:
    """The longest row as the workers pad it under context parallelism: up to a multiple of ``2 x CP`` (times
    TP with sequence parallelism), which the layout requires (``parallel/layout.py``). An impossible layout
    is left to :meth:`PlanInput.validate`, which names its field."""
    try:
        layout = cfg.parallel.layout(cfg.world_size)
    except LayoutError:
        return seq_length
    multiple = layout.sequence_multiple if layout.cp > 1 else 1
    return -(-seq_length // multiple) * multiple


def _lora_targets(cfg: RunConfig) -> tuple[str, ...]:
    lora = cfg.model.lora_spec()
    return lora.targets if lora is not None else LORA_ALL_LINEAR
