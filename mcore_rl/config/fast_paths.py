"""The step's exact fast paths, on by default wherever they hold: ``model.use_remove_padding`` and
``model.share_prompt_prefix`` left at None (auto) turn on where the layout, device and model allow them and off,
with the reason, where they do not. A value set to true stays true (the rules refuse it where it cannot run);
false stays false. The third fast path, verl's on-policy shortcut (``algorithm.recompute_old_log_probs=auto``),
is decided per step from the update plan (``trainer/step.py``); :func:`fast_path_summary` says which way.

Conditions (each measured exact in its tests; a path stays off where it has not been verified):
- packing (remove padding): pipeline size 1 (pipeline schedules send fixed-shape activations), the local layer
  spec on CPU (Transformer Engine's packed attention has not run on a GPU here yet), full causal attention (no
  sliding window), a dense model (packed micro-batches have not been measured with expert parallelism);
- shared prompts: packing's conditions, and ``rollout.n > 1`` (nothing to share otherwise) and context
  parallel size 1 (a shared prompt's rows cannot be split over CP ranks).

Nothing here imports megatron; torch only to ask whether a GPU is present when ``trainer.device=auto``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcore_rl.config.run import RunConfig


def compute_device(cfg: RunConfig) -> str:
    """The device the ranks compute on: ``trainer.device``, with auto resolved here."""
    if cfg.trainer.device != "auto":
        return str(cfg.trainer.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def packing_blocker(cfg: RunConfig) -> str | None:
    """Why rows cannot be packed (``model.use_remove_padding``) by default, or None when they can."""
    if cfg.parallel.pipeline_model_parallel_size > 1:
        return f"parallel.pipeline_model_parallel_size={cfg.parallel.pipeline_model_parallel_size}"
    if compute_device(cfg) != "cpu":
        return "not yet verified with Transformer Engine's packed attention on a GPU"
    from mcore_rl.io.errors import ConfigError

    try:
        arch = cfg.model.arch()
    except (ConfigError, OSError):  # a missing model folder is refused by check_paths, naming it
        return "the model's config.json could not be read"
    if arch.sliding_window is not None:
        return f"the model's sliding window ({arch.sliding_window} tokens)"
    if arch.moe is not None:
        return "not yet verified with mixture-of-experts models"
    return None


def sharing_blocker(cfg: RunConfig, packing: str | None) -> str | None:
    """Why prompts cannot be shared (``model.share_prompt_prefix``) by default, or None when they can."""
    if packing is not None:
        return packing
    if cfg.rollout.n < 2:
        return f"rollout.n={cfg.rollout.n} (no group shares a prompt)"
    if cfg.parallel.context_parallel_size > 1:
        return f"parallel.context_parallel_size={cfg.parallel.context_parallel_size}"
    if cfg.model.lora_rank and cfg.model.lora_dropout:  # the padded path draws a mask per row
        return (
            f"model.lora_dropout={cfg.model.lora_dropout} (a shared prompt would draw one mask for its group)"
        )
    return None


def resolve_fast_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the auto (None) fast-path keys set to true or false; keys already set are kept."""
    model = cfg.model
    if model.use_remove_padding is not None and model.share_prompt_prefix is not None:
        return cfg
    packing = packing_blocker(cfg)
    remove_padding = packing is None if model.use_remove_padding is None else model.use_remove_padding
    share = model.share_prompt_prefix
    if share is None:  # rows padded on purpose (use_remove_padding=false) keep the padded path everywhere
        share = remove_padding and sharing_blocker(cfg, packing) is None
    model = dataclasses.replace(model, use_remove_padding=remove_padding, share_prompt_prefix=share)
    return dataclasses.replace(cfg, model=model)


def describe_fast_paths(cfg: RunConfig) -> list[str]:
    """What a resolved config's packing keys do and, where off, what keeps them off (logged once per run)."""
    packing = packing_blocker(cfg)
    lines = []
    if cfg.model.use_remove_padding:
        lines.append("model.use_remove_padding=true (rows packed, no padding computed)")
    else:
        lines.append(f"model.use_remove_padding=false ({packing or 'set false'})")
    if cfg.model.share_prompt_prefix:
        lines.append("model.share_prompt_prefix=true (each prompt computed once per group)")
    else:
        padded = "model.use_remove_padding=false" if not cfg.model.use_remove_padding else None
        lines.append(
            f"model.share_prompt_prefix=false ({sharing_blocker(cfg, packing) or padded or 'set false'})"
        )
    return lines


def keep_logits_setting(cfg: RunConfig) -> int | None:
    """``model.keep_logits_gib`` in bytes as the ranks take it (None: ``engine/lm_head.py``'s default for the
    device). Unset, nothing is kept where the CPU ranks' host cache is off (``trainer.host_cache_gib=0``):
    without it the kept block is faulted in fresh every step, which on these VMs cost more than the GEMM it
    saves (the scaling sweep with its cache emptied after every step: the 128 x 8 update 16.4 s against 5.5 s)."""
    if cfg.model.keep_logits_gib is None:
        return 0 if cfg.trainer.host_cache_gib == 0 else None
    return int(cfg.model.keep_logits_gib * (1 << 30))
