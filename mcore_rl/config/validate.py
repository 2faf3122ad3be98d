"""The rules of a :class:`~mcore_rl.config.run.RunConfig` that span fields or sections, checked before any
process starts: the layout fits the world size and the model, batch sizes split evenly over data-parallel
ranks and micro-batches, lengths fit the model's positions, options that need each other are set together.
All problems are reported at once, one line each. Each field's own type and range are checked by its section
when it is built (``__post_init__``, :mod:`mcore_rl.io.fields`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from mcore_rl.algo.settings import AdvEstimator, DPOLossType
from mcore_rl.config.batch_rules import (
    batch_problems,
    critic_problems,
)
from mcore_rl.config.model import RolloutEngineName
from mcore_rl.config.run import RunConfig
from mcore_rl.engine.lora_spec import moe_targets_problem
from mcore_rl.io.errors import ConfigError


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


MODEL_FOLDER_KEYS = ("model.path", "critic.model_path", "reward_model.path")
"""Keys naming a local Hugging Face model folder (never a hub id: nothing is downloaded)."""


def validate(cfg: RunConfig, check_paths: bool = False) -> None:
    """Raise :class:`ConfigError` listing every broken rule; ``check_paths`` also requires the data files,
    the model folder and the tokenizer to exist (the driver checks them once data generation has run)."""
    problems = config_problems(cfg, check_paths)
    if problems:
        raise ConfigError(problems_message(problems))


def problems_message(problems: Sequence[str]) -> str:
    """Every problem on a line of its own, each ending in ``;`` so that the CLI's one-line form still parts
    them: ``invalid run config (2 problems): a; b``."""
    if len(problems) == 1:
        return f"invalid run config: {problems[0]}"
    return f"invalid run config ({len(problems)} problems):\n  " + ";\n  ".join(problems)


def check_paths(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` naming each input file or folder that is missing (the model, the tokenizer,
    the data), before anything reads them: a missing ``model.path`` is named as itself, not as the tokenizer
    error loading it would give."""
    problems = _path_problems(cfg)
    if problems:
        raise ConfigError(problems_message(problems))


def config_problems(cfg: RunConfig, check_paths: bool = False) -> list[str]:
    """Every broken rule of :func:`validate`, one line each (empty when the config can run)."""
    problems = world_size_problems(cfg) + _run_problems(cfg) + _algorithm_problems(cfg)
    problems += _adapter_reference_problems(cfg)
    problems += _hub_id_problems(cfg)
    if check_paths:
        problems += _path_problems(cfg)
    return problems


def world_size_problems(cfg: RunConfig) -> list[str]:
    """The rules the world size enters: the layouts fit it and the model, and the batches split over its
    data-parallel ranks (``trainer.n_gpus_per_node=null`` takes the most ranks these allow)."""
    layout = _layout_problems(cfg)
    return layout + ([] if layout else batch_problems(cfg))


def _looks_like_hub_id(path: str) -> bool:
    """``owner/name`` (as ``Qwen/Qwen2.5-0.5B-Instruct``) and no such file or folder here."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path)) and not os.path.exists(path)


def _hub_id_problems(cfg: RunConfig) -> list[str]:
    """A hub id given as a model folder, found now rather than as a tokenizer error once the run starts."""
    problems = []
    for key in MODEL_FOLDER_KEYS:
        path = get_key(cfg, key)
        if path is not None and _looks_like_hub_id(path):
            problems.append(
                f"{key}={path}: no such local folder; {key} must be a local folder (no downloads); got a hub "
                f"id? Download it first (e.g. `huggingface-cli download {path} --local-dir DIR`) and set {key}=DIR"
            )
    return problems


def _layout_problems(cfg: RunConfig) -> list[str]:
    """The training and rollout layouts fit the world size and the model."""
    from mcore_rl.parallel.layout import LayoutError

    par, world = cfg.parallel, cfg.world_size
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    problems = []
    if world % (tp * pp * cp):
        return [
            "parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size * "
            f"parallel.context_parallel_size = {tp} * {pp} * {cp} = {tp * pp * cp} does not divide the world "
            f"size {world} (trainer.nnodes * trainer.n_gpus_per_node)"
        ]
    if par.data_parallel_size is not None and par.data_parallel_size != world // (tp * pp * cp):
        problems.append(
            f"parallel.data_parallel_size={par.data_parallel_size} but world size {world} / (TP*PP*CP="
            f"{tp * pp * cp}) gives {world // (tp * pp * cp)}"
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
    except ConfigError as err:
        return [f"model: {err}"]
    try:
        layout = par.layout(world)
        layout.check_model(
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_query_groups,
            num_layers=arch.num_layers,
            num_experts=arch.moe.num_experts if arch.moe else None,
            moe_ffn_hidden_size=arch.moe.ffn_hidden_size if arch.moe else None,
        )
    except LayoutError as err:
        problems.append(f"parallel: {err}")
    problems += _moe_problems(cfg, arch)
    for heads, name in ((arch.num_attention_heads, "attention heads"), (arch.num_query_groups, "kv heads")):
        if heads % tp_g:
            problems.append(f"rollout.tensor_model_parallel_size={tp_g} does not divide the {heads} {name}")
    dense = arch.moe is None or len(arch.moe.layers) < arch.num_layers
    if dense and arch.ffn_hidden_size % tp_g:  # found by the reshard plan only after the workers started
        problems.append(
            f"rollout.tensor_model_parallel_size={tp_g} does not divide the intermediate_size={arch.ffn_hidden_size}"
        )
    if (
        cfg.rollout.colocate and tp_g % tp and tp % tp_g
    ):  # the sync splits one layout's shards into the other's
        problems.append(
            f"rollout.tensor_model_parallel_size={tp_g} and parallel.tensor_model_parallel_size={tp} must nest "
            "(one divides the other)"
        )
    if cfg.rollout.name == RolloutEngineName.VLLM:
        problems += _vllm_problems(cfg, arch)
    response, response_key = cfg.data.max_response_length, "data.max_response_length"
    if (
        cfg.rollout.response_length > response
    ):  # what the rollout engines are sized for (vLLM's max_model_len)
        response, response_key = cfg.rollout.response_length, "rollout.response_length"
    total = cfg.data.max_prompt_length + response
    if total > arch.max_position_embeddings:
        problems.append(
            f"data.max_prompt_length + {response_key} = {total} exceeds the model's "
            f"max_position_embeddings={arch.max_position_embeddings}"
        )
    return problems


def _moe_problems(cfg: RunConfig, arch: Any) -> list[str]:
    """Mixture-of-experts settings that the model or the run cannot honour."""
    problems = []
    tp_g = cfg.rollout.tensor_model_parallel_size
    if arch.moe is not None and arch.moe.ffn_hidden_size % tp_g:
        field = "intermediate_size" if arch.family == "mixtral" else "moe_intermediate_size"
        problems.append(
            f"rollout.tensor_model_parallel_size={tp_g} does not divide the experts' {field}="
            f"{arch.moe.ffn_hidden_size} (every rollout rank holds a slice of every expert)"
        )
    lora = cfg.model.lora_spec()
    if lora is not None and arch.moe is not None and (problem := moe_targets_problem(lora.targets)):
        problems.append(problem)
    if cfg.actor.router_replay:
        if arch.moe is None:
            problems.append("actor.router_replay=true applies to mixture-of-experts models only")
        elif cfg.rollout.multi_turn.enable:  # no engine records a conversation's turns
            problems.append(
                "actor.router_replay=true is not supported with rollout.multi_turn.enable=true yet"
            )
    return problems


def _vllm_problems(cfg: RunConfig, arch: Any) -> list[str]:
    """What vLLM would refuse, found before any process starts (``rollout.name=vllm``)."""
    import importlib.util

    from mcore_rl.engine.rollout.vllm_compat import preflight_problems
    from mcore_rl.engine.rollout.vllm_layout import vllm_sampling_problems

    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    installed = importlib.util.find_spec("vllm") is not None
    rollout_dtype = cfg.rollout.hybrid.rollout_dtype
    dtype = (
        ("rollout.hybrid.rollout_dtype", rollout_dtype) if rollout_dtype else ("model.dtype", cfg.model.dtype)
    )
    capability = None
    if device == "cuda":
        import torch

        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    problems = preflight_problems(
        arch,
        cfg.rollout.tensor_model_parallel_size,
        device == "cuda",
        installed,
        dtype,
        capability,
        router_replay=cfg.actor.router_replay,
    )
    for prefix, sampling in (("rollout", cfg.rollout), ("rollout.val_kwargs", cfg.rollout.val_kwargs)):
        if sampling.temperature > 0 and (0 < sampling.top_k < arch.vocab_size or sampling.top_p < 1.0):
            problems.append(
                f"{prefix}.top_k={sampling.top_k} / {prefix}.top_p={sampling.top_p} with rollout.name=vllm: vLLM "
                "reports log-probs of the filtered distribution, which the actor cannot recompute; turn filtering "
                "off or use rollout.name=local"
            )
        problems += [f"{prefix}.{p}" for p in vllm_sampling_problems(sampling.temperature, sampling.n)]
    return problems


def _run_problems(cfg: RunConfig) -> list[str]:
    problems = []
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if not cfg.data.train_files and not cfg.dpo.train_files:
        problems.append("data.train_files is empty: give at least one .parquet or .jsonl file")
    if cfg.dpo.label_smoothing and cfg.dpo.loss_type in (DPOLossType.HINGE, DPOLossType.IPO):
        problems.append(
            f"dpo.label_smoothing={cfg.dpo.label_smoothing} applies to loss_type sigmoid and robust only, "
            f"not {cfg.dpo.loss_type}"
        )
    if trainer.test_freq > 0 and not cfg.data.val_files and not cfg.dpo.train_files:
        problems.append(f"trainer.test_freq={trainer.test_freq} needs data.val_files")
    if cfg.sft.enable and not cfg.sft.train_files:
        problems.append("sft.enable=true needs sft.train_files")
    if cfg.sft.enable and cfg.sft.target_val_accuracy is not None and not cfg.sft.val_files:
        problems.append(f"sft.target_val_accuracy={cfg.sft.target_val_accuracy} needs sft.val_files")
    kl = _kl_terms(cfg)
    if cfg.sft.enable and cfg.model.lora_rank and kl:
        problems.append(
            f"sft.enable=true with model.lora_rank={cfg.model.lora_rank} and algorithm.{kl[0]}=true: the KL "
            "reference of a LoRA run is its frozen base, not the SFT warm start RL begins from; run `mcore-rl sft` "
            "first and start RL from its model (recipes/demo_lora_cpu.yaml), or turn the KL term off"
        )
    problems += critic_problems(cfg)
    if cfg.model.share_prompt_prefix and cfg.parallel.context_parallel_size > 1:
        problems.append(
            f"model.share_prompt_prefix=true with parallel.context_parallel_size={cfg.parallel.context_parallel_size}: "
            "a shared prompt's rows cannot be split over CP ranks; turn one of them off (model.use_remove_padding "
            "packs rows under CP)"
        )
    for packing in ("use_remove_padding", "share_prompt_prefix"):
        if getattr(cfg.model, packing) and cfg.parallel.pipeline_model_parallel_size > 1:
            problems.append(
                f"model.{packing}=true packs rows into sequences of varying length, which pipeline "
                "schedules cannot send: needs parallel.pipeline_model_parallel_size=1"
            )
    rollout = cfg.rollout
    if cfg.algorithm.filter_groups.enable:
        for blocker, why in (
            (cfg.algorithm.adv_estimator == "gae", "algorithm.adv_estimator=gae (its critic's values)"),
            (trainer.one_step_off, "trainer.one_step_off=true (its rollout sampled ahead)"),
        ):
            if blocker:
                problems.append(f"algorithm.filter_groups.enable=true does not combine with {why} yet")
    overlong = cfg.reward.overlong_buffer
    if overlong.enable and overlong.len >= rollout.response_length:
        problems.append(
            f"reward.overlong_buffer.len={overlong.len} must be below rollout.response_length="
            f"{rollout.response_length} (the punishment ramps over the budget's last len tokens)"
        )
    if not rollout.colocate and rollout.num_ranks % rollout.tensor_model_parallel_size:
        problems.append(
            f"rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} does not divide "
            f"rollout.num_ranks={rollout.num_ranks} (the rollout pool, rollout.colocate=false)"
        )
    for prefix, optim in (
        ("optim", cfg.optim),
        ("sft.optim", cfg.sft.optim),
        ("critic.optim", cfg.critic.optim),
    ):
        if optim.min_lr > optim.lr:
            problems.append(f"{prefix}.min_lr={optim.min_lr} exceeds {prefix}.lr={optim.lr}")
    return problems


def _algorithm_problems(cfg: RunConfig) -> list[str]:
    """Options the RL step builds only in some combinations: refused here, before the run folder is claimed,
    rather than by the workers or at the first update."""
    if cfg.dpo.train_files:  # a DPO run neither rolls out nor runs the RL update
        return []
    alg, problems = cfg.algorithm, []
    if alg.use_kl_in_reward and alg.adv_estimator != AdvEstimator.GAE:
        problems.append(
            f"algorithm.use_kl_in_reward=true needs algorithm.adv_estimator=gae (got {alg.adv_estimator}): the "
            "per-token KL penalty feeds GAE's token rewards; the critic-free estimators take one score per "
            "sequence (use algorithm.use_kl_loss for a KL term with them)"
        )
    if alg.ppo_max_token_len_per_gpu is not None and cfg.parallel.pipeline_model_parallel_size > 1:
        problems.append(
            f"algorithm.ppo_max_token_len_per_gpu={alg.ppo_max_token_len_per_gpu} makes micro-batches of unequal "
            "shapes, which pipeline schedules cannot send: needs parallel.pipeline_model_parallel_size=1"
        )
    if cfg.rollout.temperature == 0:
        problems.append(
            "rollout.temperature=0: training samples at this temperature and its loss divides the logits by it; "
            "set a temperature > 0 (greedy validation is rollout.val_kwargs.temperature=0)"
        )
    return problems


def _kl_terms(cfg: RunConfig) -> list[str]:
    """The ``algorithm`` KL keys switched on: each needs a reference policy."""
    return [k for k in ("use_kl_loss", "use_kl_in_reward") if getattr(cfg.algorithm, k)]


def _adapter_reference_problems(cfg: RunConfig) -> list[str]:
    """``model.lora_adapter_path`` with a reference model: a LoRA run's reference is its base with the adapters
    off (``TrainEngine.frozen_copy``), not the base + loaded adapter the run starts from, so its KL (RL) or
    its rewards (DPO) would not start at 0."""
    path = cfg.model.lora_adapter_path
    if path is None:
        return []
    merge = (
        f"merge the adapter (mcore-rl convert mcore-to-hf --ckpt {path} --merge-lora --base "
        f"{cfg.model.path or 'HF_DIR'} --out DIR) and start from model.path=DIR without model.lora_adapter_path"
    )
    if cfg.dpo.train_files:  # a DPO run
        if cfg.dpo.reference_free or cfg.dpo.precompute_ref_log_probs:
            return []  # precomputed log-probs come from the policy as loaded, adapter included
        return [
            f"model.lora_adapter_path={path} with a DPO reference model (dpo.precompute_ref_log_probs=false): "
            "a LoRA run's reference is its base with the adapters off, not the adapter DPO starts from; set "
            f"dpo.precompute_ref_log_probs=true (the reference is then the policy as loaded), or {merge}"
        ]
    kl = _kl_terms(cfg)
    if not kl:
        return []
    return [
        f"model.lora_adapter_path={path} with algorithm.{kl[0]}=true: the KL reference of a LoRA run is its "
        f"base with the adapters off, not the adapter RL starts from; {merge}, or turn the KL term off"
    ]


def _path_problems(cfg: RunConfig) -> list[str]:
    files = [
        *(("data.train_files", f) for f in cfg.data.train_files),
        *(("data.val_files", f) for f in cfg.data.val_files),
        *(("data.test_files", f) for f in cfg.data.test_files),
        *(("sft.train_files", f) for f in (cfg.sft.train_files if cfg.sft.enable else [])),
        *(
            ("sft.val_files", f)
            for f in (cfg.sft.val_files if cfg.sft.enable else [])
            if f not in cfg.data.val_files
        ),
        *(("dpo.train_files", f) for f in cfg.dpo.train_files),
        *(("dpo.val_files", f) for f in cfg.dpo.val_files),
    ]
    problems = [
        f"{key}: {path} {'is a folder, not a data file' if os.path.isdir(path) else 'does not exist'}"
        for key, path in files
        if not os.path.isfile(path)
    ]
    folders = (get_key(cfg, key) for key in MODEL_FOLDER_KEYS)
    hub_ids = {path for path in folders if path is not None and _looks_like_hub_id(path)}
    for key in ("model.path", "model.tokenizer_path", "reward_model.path"):
        path = get_key(cfg, key)
        if path is not None and not os.path.exists(path) and path not in hub_ids:  # named once, above
            problems.append(f"{key}: {path} does not exist")
    problems += _lora_adapter_problems(cfg)
    if cfg.model.tokenizer_path is None:
        problems.append("model.tokenizer_path is not set (nor model.path): the run needs a tokenizer")
    elif _checkpoint_without_tokenizer(cfg):
        problems.append(
            f"model.tokenizer_path: model.path={cfg.model.path} is a megatron checkpoint without the "
            "tokenizer files (hf_assets/: checkpoints written before they kept one, or a conversion from a "
            "folder without them); set model.tokenizer_path to the tokenizer folder it was trained with"
        )
    return problems


def _lora_adapter_problems(cfg: RunConfig) -> list[str]:
    """``model.lora_adapter_path``: a PEFT folder whose adapters are the run's (read before any worker)."""
    path, spec = cfg.model.lora_adapter_path, cfg.model.lora_spec()
    if path is None or spec is None:
        return []
    if not os.path.isdir(path):
        return [f"model.lora_adapter_path: {path} does not exist"]
    from mcore_rl.engine.hf.peft import check_same_adapters, read_peft_spec
    from mcore_rl.io.errors import InputError

    try:
        check_same_adapters(path, read_peft_spec(path), spec)
    except InputError as err:
        return [f"model.lora_adapter_path: {err}"]
    return []


def _checkpoint_without_tokenizer(cfg: RunConfig) -> bool:
    """The tokenizer defaults to ``model.path``, a megatron checkpoint holding no tokenizer files."""
    model = cfg.model
    if model.path is None or model.tokenizer_path != model.path or not model.is_megatron_checkpoint():
        return False
    return not any(os.path.exists(os.path.join(model.path, f)) for f in ("tokenizer.json", "tokenizer.model"))
