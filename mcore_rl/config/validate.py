"""Every rule a :class:`~mcore_rl.config.run.RunConfig` must satisfy, checked before any process starts.

Field rules live in two tables keyed by the full dotted key (a dataclass's ``__post_init__`` does not know
where it sits in the tree, so it could only name the bare field). Cross-field rules follow: the layout fits
the world size and the model, batch sizes split evenly over data-parallel ranks and micro-batches, lengths
fit the model's positions. All problems are reported at once, one line each.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mcore_rl.config.dpo import DPO_LOSS_TYPES, DPOConfig
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.run import RunConfig

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_KL_NAMES = (*KL_ESTIMATORS, *(f"{name}+" for name in KL_ESTIMATORS))

CHOICES: dict[str, tuple[Any, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "parallel.backend": (None, "nccl", "gloo"),
    "rollout.name": ("local", "vllm"),
    "rollout.hybrid.sleep_level": (1, 2),
    "rollout.hybrid.rollout_dtype": (None, "float32", "bfloat16", "float16"),
    "algorithm.adv_estimator": (
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "gae",
    ),
    "algorithm.kl_loss_type": _KL_NAMES,
    "algorithm.kl_penalty": _KL_NAMES,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.loss_agg_mode": LOSS_AGG_MODES,
    "algorithm.recompute_old_log_probs": ("auto", "always"),
    "optim.lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
    "sft.optim.lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
    "critic.optim.lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
    "data.generate": (None, "arithmetic", "arithmetic_reversed"),
    "reward.on_error": ("zero", "raise"),
    "reward.gsm8k_method": ("strict", "flexible"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.on_nonfinite_loss": ("stop", "skip"),
    "dpo.loss_type": DPO_LOSS_TYPES,
}

_POSITIVE = ("> 0", lambda v: v > 0)
_NON_NEGATIVE = (">= 0", lambda v: v >= 0)
_OPTIONAL_POSITIVE = ("> 0 or null", lambda v: v is None or v > 0)
_UNIT = ("in [0, 1)", lambda v: 0 <= v < 1)
_FREQ = ("a positive step count or -1", lambda v: v == -1 or v > 0)

RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "parallel.tensor_model_parallel_size": _POSITIVE,
    "parallel.pipeline_model_parallel_size": _POSITIVE,
    "parallel.virtual_pipeline_model_parallel_size": _OPTIONAL_POSITIVE,
    "algorithm.ppo_max_token_len_per_gpu": _OPTIONAL_POSITIVE,
    "parallel.data_parallel_size": _OPTIONAL_POSITIVE,
    "parallel.timeout_minutes": _POSITIVE,
    "rollout.tensor_model_parallel_size": _POSITIVE,
    "rollout.n": _POSITIVE,
    "rollout.temperature": _NON_NEGATIVE,
    "rollout.top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "rollout.top_k": ("-1 (off) or >= 0", lambda v: v >= -1),
    "rollout.response_length": _POSITIVE,
    "rollout.stop_token_ids": ("a list of ids >= 0", lambda v: all(t >= 0 for t in v)),
    "rollout.gpu_memory_utilization": ("in (0, 1]", lambda v: 0 < v <= 1),
    "rollout.val_kwargs.temperature": _NON_NEGATIVE,
    "rollout.val_kwargs.top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "rollout.val_kwargs.n": _POSITIVE,
    "rollout.hybrid.bucket_bytes": _POSITIVE,
    "rollout.hybrid.max_inflight_bytes": _OPTIONAL_POSITIVE,
    "algorithm.gamma": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "algorithm.kl_loss_coef": _NON_NEGATIVE,
    "algorithm.kl_ctrl.kl_coef": _NON_NEGATIVE,
    "algorithm.clip_ratio_low": ("in [0, 1)", lambda v: 0 <= v < 1),
    "algorithm.clip_ratio_high": _NON_NEGATIVE,
    "algorithm.clip_ratio_c": ("> 1", lambda v: v > 1),
    "algorithm.ppo_epochs": _POSITIVE,
    "algorithm.ppo_mini_batch_size": _POSITIVE,
    "algorithm.ppo_micro_batch_size_per_gpu": _POSITIVE,
    "data.max_prompt_length": _POSITIVE,
    "data.max_response_length": _POSITIVE,
    "data.train_batch_size": _POSITIVE,
    "data.val_batch_size": _OPTIONAL_POSITIVE,
    "reward.num_workers": _NON_NEGATIVE,
    "reward.timeout_s": _POSITIVE,
    "trainer.total_epochs": _POSITIVE,
    "trainer.total_training_steps": _OPTIONAL_POSITIVE,
    "trainer.test_freq": _FREQ,
    "trainer.save_freq": _FREQ,
    "trainer.max_ckpt_to_keep": _OPTIONAL_POSITIVE,
    "trainer.nnodes": _POSITIVE,
    "trainer.n_gpus_per_node": _POSITIVE,
    "trainer.num_cpus": _OPTIONAL_POSITIVE,
    "logging.token_mult_prob_error_threshold": ("> 1", lambda v: v > 1),
    "sft.total_steps": _POSITIVE,
    "sft.train_batch_size": _POSITIVE,
    "sft.micro_batch_size_per_gpu": _POSITIVE,
    "sft.max_length": _OPTIONAL_POSITIVE,
    "sft.test_freq": _POSITIVE,
    "sft.target_val_accuracy": ("in (0, 1] or null", lambda v: v is None or 0 < v <= 1),
    "dpo.beta": _POSITIVE,
    "dpo.label_smoothing": ("in [0, 0.5)", lambda v: 0 <= v < 0.5),
    "dpo.sft_loss_weight": _NON_NEGATIVE,
    "dpo.max_length": _OPTIONAL_POSITIVE,
    "dpo.train_batch_size": _POSITIVE,
    "dpo.micro_batch_size_per_gpu": _POSITIVE,
    "dpo.test_freq": _FREQ,
    "critic.ppo_micro_batch_size_per_gpu": _POSITIVE,
    "critic.cliprange_value": _NON_NEGATIVE,
    "critic.warmup_steps": _NON_NEGATIVE,
    "critic.num_ranks": _POSITIVE,
    "rollout.num_ranks": _POSITIVE,
    "algorithm.rollout_is_threshold": ("> 1 or null", lambda v: v is None or v > 1),
    "reward_model.micro_batch_size_per_gpu": _POSITIVE,
    "algorithm.lam": ("in [0, 1]", lambda v: 0 <= v <= 1),
}
for _prefix in ("optim", "sft.optim", "critic.optim"):
    RANGES.update(
        {
            f"{_prefix}.lr": _NON_NEGATIVE,
            f"{_prefix}.min_lr": _NON_NEGATIVE,
            f"{_prefix}.lr_warmup_steps": _NON_NEGATIVE,
            f"{_prefix}.lr_decay_steps": _OPTIONAL_POSITIVE,
            f"{_prefix}.weight_decay": _NON_NEGATIVE,
            f"{_prefix}.adam_beta1": _UNIT,
            f"{_prefix}.adam_beta2": _UNIT,
            f"{_prefix}.adam_eps": _POSITIVE,
            f"{_prefix}.clip_grad": _NON_NEGATIVE,
        }
    )


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: RunConfig, check_paths: bool = False) -> None:
    """Raise :class:`ConfigError` listing every broken rule; ``check_paths`` also requires the data files,
    the model folder and the tokenizer to exist (the driver checks them once data generation has run)."""
    problems = _field_problems(cfg)
    if not problems:  # cross-field rules assume each field is in range
        layout = _layout_problems(cfg)
        problems += layout + ([] if layout else _batch_problems(cfg)) + _run_problems(cfg)
        if check_paths:
            problems += _path_problems(cfg)
    if problems:
        raise ConfigError("invalid run config:\n  " + "\n  ".join(problems))


def _field_problems(cfg: RunConfig) -> list[str]:
    problems = []
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            problems.append(f"{key}={value!r} is not allowed; choose one of: {shown}")
    for key, (what, ok) in RANGES.items():
        value = get_key(cfg, key)
        if not ok(value):
            problems.append(f"{key}={value!r} must be {what}")
    return problems


def _layout_problems(cfg: RunConfig) -> list[str]:
    """The training and rollout layouts fit the world size and the model."""
    from mcore_rl.engine.arch import ConfigError as ArchError
    from mcore_rl.parallel.layout import LayoutError, ParallelLayout

    par, world = cfg.parallel, cfg.world_size
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    problems = []
    if world % (tp * pp):
        return [
            f"parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size = {tp * pp} does "
            f"not divide the world size {world} (trainer.nnodes * trainer.n_gpus_per_node)"
        ]
    if par.data_parallel_size is not None and par.data_parallel_size != world // (tp * pp):
        problems.append(
            f"parallel.data_parallel_size={par.data_parallel_size} but world size {world} / (TP*PP={tp * pp}) "
            f"gives {world // (tp * pp)}"
        )
    if par.virtual_pipeline_model_parallel_size is not None and pp < 2:
        problems.append(
            "parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2"
        )
    if par.sequence_parallel and tp < 2:
        problems.append("parallel.sequence_parallel=true needs tensor_model_parallel_size >= 2")
    tp_g = cfg.rollout.tensor_model_parallel_size
    if cfg.rollout.colocate and world % tp_g:  # a rollout pool's ranks are checked with rollout.num_ranks
        problems.append(f"rollout.tensor_model_parallel_size={tp_g} does not divide the world size {world}")
    if cfg.model.path is None and not cfg.model.hf_config:
        return [*problems, "model: set model.path (a HF folder) or model.hf_config (an inline config.json)"]
    if problems or (cfg.model.path is not None and not os.path.isdir(cfg.model.path)):
        return problems  # a missing folder is a path problem (check_paths)
    try:
        arch = cfg.model.arch()
    except (ArchError, ConfigError) as err:
        return [f"model: {err}"]
    try:
        layout = ParallelLayout(
            world, tp, pp, par.virtual_pipeline_model_parallel_size, par.sequence_parallel
        )
        layout.check_model(
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_query_groups,
            num_layers=arch.num_layers,
        )
    except LayoutError as err:
        problems.append(f"parallel: {err}")
    for heads, name in ((arch.num_attention_heads, "attention heads"), (arch.num_query_groups, "kv heads")):
        if heads % tp_g:
            problems.append(f"rollout.tensor_model_parallel_size={tp_g} does not divide the {heads} {name}")
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if total > arch.max_position_embeddings:
        problems.append(
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
            f"max_position_embeddings={arch.max_position_embeddings}"
        )
    return problems


def _batch_problems(cfg: RunConfig) -> list[str]:
    """Prompts split evenly over rollout replicas; sequences over DP ranks, mini- and micro-batches."""
    par, alg, n = cfg.parallel, cfg.algorithm, cfg.rollout.n
    dp = cfg.world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    rollout_ranks = cfg.world_size if cfg.rollout.colocate else cfg.rollout.num_ranks
    rollout_dp = max(rollout_ranks // cfg.rollout.tensor_model_parallel_size, 1)
    if cfg.dpo.train_files:  # a DPO run has no rollout: the RL batch rules do not apply
        return _dpo_batch_problems(cfg.dpo, dp)
    batch, mini, micro = cfg.data.train_batch_size, alg.ppo_mini_batch_size, alg.ppo_micro_batch_size_per_gpu
    problems = []
    if batch % rollout_dp:
        problems.append(
            f"data.train_batch_size={batch} is not divisible by the {rollout_dp} rollout replicas"
        )
    if batch % mini:
        problems.append(
            f"data.train_batch_size={batch} is not divisible by algorithm.ppo_mini_batch_size={mini}"
        )
    elif (mini * n) % dp:
        problems.append(
            f"algorithm.ppo_mini_batch_size * rollout.n = {mini * n} sequences do not split over "
            f"data-parallel size {dp}"
        )
    elif (mini * n // dp) % micro:
        problems.append(
            f"algorithm.ppo_micro_batch_size_per_gpu={micro} does not divide the {mini * n // dp} sequences "
            f"per data-parallel rank of a mini-batch (ppo_mini_batch_size * rollout.n / DP)"
        )
    if cfg.algorithm.adv_estimator in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline") and n < 2:
        problems.append(
            f"rollout.n={n}: algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses "
            "within a group and needs rollout.n >= 2"
        )
    if cfg.sft.enable:
        sft_batch, sft_micro = cfg.sft.train_batch_size, cfg.sft.micro_batch_size_per_gpu
        if sft_batch % dp:
            problems.append(f"sft.train_batch_size={sft_batch} is not divisible by data-parallel size {dp}")
        elif (sft_batch // dp) % sft_micro:
            problems.append(
                f"sft.micro_batch_size_per_gpu={sft_micro} does not divide the {sft_batch // dp} examples "
                "per data-parallel rank"
            )
    return problems


def _dpo_batch_problems(dpo: DPOConfig, dp: int) -> list[str]:
    """Preference pairs split evenly over data-parallel ranks and micro-batches (pairs are never split)."""
    if not dpo.train_files:
        return []
    batch, micro = dpo.train_batch_size, dpo.micro_batch_size_per_gpu
    if batch % dp:
        return [f"dpo.train_batch_size={batch} pairs are not divisible by data-parallel size {dp}"]
    if (batch // dp) % micro:
        return [
            f"dpo.micro_batch_size_per_gpu={micro} does not divide the {batch // dp} pairs per data-parallel rank"
        ]
    return []


def _run_problems(cfg: RunConfig) -> list[str]:
    problems = []
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if not cfg.data.train_files and not cfg.dpo.train_files:
        problems.append("data.train_files is empty: give at least one .parquet or .jsonl file")
    if cfg.dpo.label_smoothing and cfg.dpo.loss_type in ("hinge", "ipo"):
        problems.append(
            f"dpo.label_smoothing={cfg.dpo.label_smoothing} applies to loss_type sigmoid and robust only, "
            f"not {cfg.dpo.loss_type}"
        )
    if trainer.test_freq > 0 and not cfg.data.val_files and not cfg.dpo.train_files:
        problems.append(f"trainer.test_freq={trainer.test_freq} needs data.val_files")
    if cfg.sft.enable and not cfg.sft.train_files:
        problems.append("sft.enable=true needs sft.train_files")
    problems += _critic_problems(cfg)
    for packing in ("use_remove_padding", "share_prompt_prefix"):
        if getattr(cfg.model, packing) and cfg.parallel.pipeline_model_parallel_size > 1:
            problems.append(
                f"model.{packing}=true packs rows into sequences of varying length, which pipeline "
                "schedules cannot send: needs parallel.pipeline_model_parallel_size=1"
            )
    rollout = cfg.rollout
    if not rollout.colocate and rollout.num_ranks % rollout.tensor_model_parallel_size:
        problems.append(
            f"rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} does not divide "
            f"rollout.num_ranks={rollout.num_ranks} (the rollout pool, rollout.colocate=false)"
        )
    if not rollout.colocate and rollout.name != "local":
        problems.append(f"rollout.colocate=false runs the local engine on its own pool, not {rollout.name}")
    for prefix, optim in (
        ("optim", cfg.optim),
        ("sft.optim", cfg.sft.optim),
        ("critic.optim", cfg.critic.optim),
    ):
        if optim.min_lr > optim.lr:
            problems.append(f"{prefix}.min_lr={optim.min_lr} exceeds {prefix}.lr={optim.lr}")
    return problems


def _critic_problems(cfg: RunConfig) -> list[str]:
    """A colocated critic shares the actor's processes (so its layout); its micro-batches split evenly."""
    critic, problems = cfg.critic, []
    if critic.colocate and critic.parallel is not None and critic.parallel != cfg.parallel:
        problems.append(
            "critic.parallel differs from parallel, but critic.colocate=true runs the critic in the actor's "
            "processes (same layout): drop critic.parallel or set it equal"
        )
    if cfg.algorithm.adv_estimator != "gae":
        return problems
    par, alg = critic.parallel or cfg.parallel, cfg.algorithm
    world = cfg.world_size if critic.colocate else critic.num_ranks
    if world % (par.tensor_model_parallel_size * par.pipeline_model_parallel_size):
        return [
            *problems,
            f"critic.parallel: TP*PP = {par.tensor_model_parallel_size * par.pipeline_model_parallel_size} "
            f"does not divide the critic's {world} ranks (critic.num_ranks)",
        ]
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    rows = alg.ppo_mini_batch_size * cfg.rollout.n // max(dp, 1)
    if (alg.ppo_mini_batch_size * cfg.rollout.n) % dp:
        problems.append(
            f"algorithm.ppo_mini_batch_size * rollout.n = {alg.ppo_mini_batch_size * cfg.rollout.n} sequences "
            f"do not split over the critic's data-parallel size {dp}"
        )
    elif rows and rows % critic.ppo_micro_batch_size_per_gpu:
        problems.append(
            f"critic.ppo_micro_batch_size_per_gpu={critic.ppo_micro_batch_size_per_gpu} does not divide the "
            f"{rows} sequences per data-parallel rank of a mini-batch (ppo_mini_batch_size * rollout.n / DP)"
        )
    return problems


def _path_problems(cfg: RunConfig) -> list[str]:
    files = [
        *(("data.train_files", f) for f in cfg.data.train_files),
        *(("data.val_files", f) for f in cfg.data.val_files),
        *(("data.test_files", f) for f in cfg.data.test_files),
        *(("sft.train_files", f) for f in (cfg.sft.train_files if cfg.sft.enable else [])),
        *(("dpo.train_files", f) for f in cfg.dpo.train_files),
        *(("dpo.val_files", f) for f in cfg.dpo.val_files),
    ]
    problems = [f"{key}: {path} does not exist" for key, path in files if not os.path.isfile(path)]
    for key in ("model.path", "model.tokenizer_path", "reward_model.path"):
        path = get_key(cfg, key)
        if path is not None and not os.path.exists(path):
            problems.append(f"{key}: {path} does not exist")
    if cfg.model.tokenizer_path is None:
        problems.append("model.tokenizer_path is not set (nor model.path): the run needs a tokenizer")
    return problems
