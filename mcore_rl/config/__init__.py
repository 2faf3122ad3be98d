"""Run configuration: one typed schema, YAML recipes and ``key=value`` overrides (OmegaConf).

The schema is :class:`RunConfig` (:mod:`mcore_rl.config.run`) composing one dataclass per section, each
defined once: next to its component when the component sits below the config (``parallel`` and
``rollout.hybrid`` in :mod:`mcore_rl.parallel.config`, ``optim`` in :mod:`mcore_rl.engine.optim`, ``data`` in
:mod:`mcore_rl.data.config`, ``reward`` in :mod:`mcore_rl.scoring.config`, ``logging`` in
:mod:`mcore_rl.logs.config`, ``algorithm.kl_ctrl`` in :mod:`mcore_rl.algo.settings`), here otherwise. YAML
recipes (``recipes/``) and overrides load into them, nothing else describes a run. Keys follow verl where
the meaning is the same::

    model:      path, hf_config, tokenizer_path, load_weights, dtype, scaled_output_init, use_remove_padding,
                share_prompt_prefix, keep_logits_gib, moe_aux_loss_coeff, moe_z_loss_coeff, lora_rank, lora_alpha,
                target_modules, lora_dropout, lora_adapter_path    (LoRA: engine/lora.py)
    actor:      router_replay                                     (mixture-of-experts models)
    parallel:   tensor_model_parallel_size, pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size, sequence_parallel, context_parallel_size,
                expert_model_parallel_size, expert_tensor_parallel_size, data_parallel_size, backend,
                timeout_minutes                                   (training layout: actor and reference)
    rollout:    name, tensor_model_parallel_size, n, temperature, top_p, top_k,
                response_length (= data.max_response_length), stop_token_ids, gpu_memory_utilization,
                val_kwargs {temperature, top_p, top_k, n}, hybrid {offload_*, sleep_level, bucket_bytes, ...},
                colocate, num_ranks                  (false: a rollout pool of its own, for one_step_off)
    algorithm:  adv_estimator, norm_adv_by_std_in_grpo, gamma, lam, use_kl_loss, kl_loss_coef,
                kl_loss_type, use_kl_in_reward, kl_penalty, kl_ctrl {type, kl_coef, target_kl, horizon},
                clip_ratio_low/high/c, loss_agg_mode, entropy_coeff, ppo_epochs,
                ppo_mini_batch_size (prompts), ppo_micro_batch_size_per_gpu (sequences),
                ppo_max_token_len_per_gpu (token-budget micro-batches, balanced over DP),
                recompute_old_log_probs (auto: verl's on-policy shortcut, always),
                rollout_is_threshold (truncated importance weights of lagged rollouts)
    optim:      lr, min_lr, lr_warmup_steps, lr_decay_style, lr_decay_steps, weight_decay,
                adam_beta1/2, adam_eps, clip_grad, use_distributed_optimizer      (the RL stage)
    data:       train_files, val_files, test_files, prompt_key, reward_fn_key, max_prompt_length,
                max_response_length, train_batch_size (prompts per step), val_batch_size,
                filter_overlong_prompts, skip_bad_rows, apply_chat_template, shuffle, seed, drop_last
    reward:     custom_function, sources {data_source: scorer}, on_error, num_workers, timeout_s,
                gsm8k_method, format_score
    trainer:    project_name, experiment_name, total_epochs, total_training_steps, test_freq,
                val_before_train, save_freq, resume_mode, resume_from_path, max_ckpt_to_keep,
                default_local_dir, seed, nnodes, n_gpus_per_node, device, ray_address, num_cpus,
                host_cache_gib, on_nonfinite_loss, overlap_stages, one_step_off
    logging:    log_dir, jsonl, tensorboard, progress_bar, plot, token_mult_prob_error_threshold,
                log_val_generations, wandb, wandb_mode, mlflow, mlflow_tracking_uri, tracker_project,
                tracker_run_name
    sft:        enable, train_files, val_files, response_key, messages_key, total_steps, train_batch_size,
                micro_batch_size_per_gpu, max_length, optim {as optim}, test_freq, target_val_accuracy
    dpo:        train_files, val_files, chosen_key, rejected_key, loss_type, beta, label_smoothing,
                reference_free, precompute_ref_log_probs, sft_loss_weight, max_length, train_batch_size,
                micro_batch_size_per_gpu, test_freq                     (``mcore-rl dpo``)
    critic:     model_path, colocate, parallel {as parallel, null: the actor's}, optim {as optim},
                num_ranks, ppo_micro_batch_size_per_gpu, cliprange_value, warmup_steps  (PPO: adv_estimator=gae)
    reward_model: path (HF *ForSequenceClassification or its converted checkpoint), weight, rule_weight,
                micro_batch_size_per_gpu

Python API::

    cfg = load_config("recipes/demo_cpu.yaml", ["rollout.n=8", "trainer.total_training_steps=20"])
    cfg = check_config(RunConfig(model=ModelConfig(path="/models/my-model"), data=DataConfig(train_files=[...])))
    save_config(cfg, run_dir)          # run_dir/config.yaml, the resolved config

``mcore-rl config show RECIPE [k=v ...]`` prints the resolved config.
"""

from mcore_rl.algo.settings import KLControl
from mcore_rl.config.algorithm import AlgorithmConfig
from mcore_rl.config.critic import CriticConfig
from mcore_rl.config.dpo import DPOConfig
from mcore_rl.config.loader import (
    CONFIG_FILE,
    check_config,
    config_to_yaml,
    load_config,
    save_config,
    schema_node,
)
from mcore_rl.config.model import ModelConfig, RolloutConfig, ValSampling
from mcore_rl.config.reward_model import RewardModelConfig
from mcore_rl.config.run import RunConfig, SFTConfig, TrainerConfig
from mcore_rl.config.run_folder import claim_run_folders
from mcore_rl.config.validate import check_paths, validate
from mcore_rl.data.config import DataConfig
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.io.errors import ConfigError
from mcore_rl.logs.config import LoggingConfig
from mcore_rl.parallel.config import HybridConfig, ParallelConfig
from mcore_rl.scoring.config import RewardConfig

__all__ = [
    "CONFIG_FILE",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "HybridConfig",
    "KLControl",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TrainerConfig",
    "ValSampling",
    "check_config",
    "check_paths",
    "claim_run_folders",
    "config_to_yaml",
    "load_config",
    "save_config",
    "schema_node",
    "validate",
]
