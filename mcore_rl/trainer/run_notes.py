"""The run's note on its fast paths (``mcore-rl: note: fast paths: ...``, logged once at the start): what each
exact fast path does in this run's layout, or what keeps it off (``config/fast_paths.py``)."""

from __future__ import annotations

import torch

from mcore_rl.algo.settings import AdvEstimator
from mcore_rl.config import RunConfig
from mcore_rl.config.fast_paths import compute_device, describe_fast_paths, keep_logits_setting
from mcore_rl.config.machine import describe_cpu_layout
from mcore_rl.engine.lm_head import describe_keep_logits
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory_of_run
from mcore_rl.trainer.groups.actor import balances_groups
from mcore_rl.trainer.on_policy import old_log_prob_line, training_dropout
from mcore_rl.trainer.step import update_plan


def balance_line(cfg: RunConfig) -> str:
    """``trainer.balance_batch`` for the note: what it does in this layout, or what keeps it off."""
    if not cfg.trainer.balance_batch:
        return "trainer.balance_batch=false (the update's rows dealt to the ranks in batch order)"
    dp = cfg.parallel.layout(cfg.world_size).dp
    plan = update_plan(cfg)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    if dp < 2:
        return "trainer.balance_batch=true (one data-parallel rank: nothing to balance)"
    if not balances_groups(rows, plan.num_mini_batches, dp, plan.balance_group_size):
        share = rows // plan.num_mini_batches // dp
        return (
            f"trainer.balance_batch=true but off: a rank's share of a mini-batch ({share} rows) is not whole "
            f"groups of rollout.n={cfg.rollout.n}"
        )
    return f"trainer.balance_batch=true (each mini-batch's prompt groups dealt to the {dp} ranks by tokens)"


def fast_path_note(cfg: RunConfig) -> str:
    """One line: what the run's exact fast paths do, and what keeps any of them off (``config/fast_paths.py``;
    critic-free estimators also the on-policy shortcut)."""
    lines = describe_fast_paths(cfg)
    if cfg.algorithm.adv_estimator != AdvEstimator.GAE:
        lag, dropout = int(cfg.trainer.one_step_off), training_dropout(cfg.model)
        lines.append(old_log_prob_line(cfg.algorithm, update_plan(cfg), lag, dropout))
    if cfg.algorithm.ppo_max_token_len_per_gpu is None:
        lines.append(balance_line(cfg))
    device = compute_device(cfg)
    if device == "cpu":
        lines.append(describe_cpu_layout(cfg))
        lines.append(keep_freed_host_memory_of_run(cfg.trainer.host_cache_gib, cfg.world_size, apply=False))
    setting = keep_logits_setting(cfg)
    # only an unset key resolves to 0 through the host cache (config/fast_paths.py)
    host_cache_off = setting == 0 and cfg.model.keep_logits_gib is None
    lines.append(describe_keep_logits(setting, torch.device(device), cfg.world_size, host_cache_off))
    return "fast paths: " + "; ".join(lines)
