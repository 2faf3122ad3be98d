"""The batch rules of a run: prompts split evenly over the rollout replicas, sequences over the data-parallel
ranks, mini- and micro-batches, for the actor, the critic and the reward model, and the epoch's short last
batch (``data.drop_last=false``) split as a full one. Part of :mod:`mcore_rl.config.validate`'s checks."""

from __future__ import annotations

from typing import Any

from mcore_rl.algo.settings import AdvEstimator
from mcore_rl.config.dpo import DPOConfig
from mcore_rl.config.run import RunConfig


def model_copy_ranks(par: Any) -> int:
    """Ranks that read the same rows: TP x PP x CP (context-parallel ranks split each row's tokens)."""
    return int(par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size)


def data_parallel_size(cfg: RunConfig) -> int:
    return cfg.world_size // model_copy_ranks(cfg.parallel)


def rollout_replicas(cfg: RunConfig) -> int:
    rollout_ranks = cfg.world_size if cfg.rollout.colocate else cfg.rollout.num_ranks
    return max(rollout_ranks // cfg.rollout.tensor_model_parallel_size, 1)


def last_batch_problem(cfg: RunConfig, num_prompts: int) -> str | None:
    """With ``data.drop_last=false`` the epoch's last batch holds ``num_prompts % data.train_batch_size``
    prompts, and the step splits them as it splits a full batch: over the rollout replicas, its sequences over
    the data-parallel ranks and into the plan's ``train_batch_size / ppo_mini_batch_size`` mini-batches, each
    rank's share of one into micro-batches of ``ppo_micro_batch_size_per_gpu`` (unless a token budget sizes
    them). Refused here, naming the key, where that split does not come out even: else the step fails hours in."""
    batch, alg = cfg.data.train_batch_size, cfg.algorithm
    rest = num_prompts % batch
    if cfg.data.drop_last or not rest:
        return None
    dp = data_parallel_size(cfg)
    mini_batches, replicas = batch // alg.ppo_mini_batch_size, rollout_replicas(cfg)
    share, uneven = divmod(rest * cfg.rollout.n, dp * mini_batches)
    micro_uneven = alg.ppo_max_token_len_per_gpu is None and share % alg.ppo_micro_batch_size_per_gpu
    if rest % replicas or uneven or micro_uneven:
        return _last_batch_message(cfg, num_prompts, rest, replicas, dp, mini_batches)
    rows = rest * cfg.rollout.n // dp  # every rank's rows of the whole batch: values and reward-model scores
    if cfg.reward_model.path is not None and not _splits(rows, cfg.reward_model.micro_batch_size_per_gpu):
        return _last_batch_message(cfg, num_prompts, rest, replicas, dp, mini_batches, "reward_model")
    if cfg.algorithm.adv_estimator == AdvEstimator.GAE:  # the critic splits the batch over its own ranks
        world, par = _critic_ranks(cfg)
        critic_dp = max(world // model_copy_ranks(par), 1)
        critic_share, critic_uneven = divmod(rest * cfg.rollout.n, critic_dp * mini_batches)
        micro = cfg.critic.ppo_micro_batch_size_per_gpu
        if critic_uneven or not (
            _splits(rest * cfg.rollout.n // critic_dp, micro) and _splits(critic_share, micro)
        ):
            return _last_batch_message(cfg, num_prompts, rest, replicas, critic_dp, mini_batches, "critic")
    return None


def _critic_ranks(cfg: RunConfig) -> tuple[int, Any]:
    """The critic's ranks and layout: the actor's world and layout when colocated, else its own pool's."""
    critic = cfg.critic
    return (cfg.world_size if critic.colocate else critic.num_ranks), (critic.parallel or cfg.parallel)


def _splits(rows: int, micro: int) -> bool:
    """``rows`` split into micro-batches as the groups split them: of ``micro`` rows, or one of them all."""
    return rows % min(micro, max(rows, 1)) == 0


def _last_batch_message(
    cfg: RunConfig, num_prompts: int, rest: int, replicas: int, dp: int, mini_batches: int, who: str = ""
) -> str:
    alg = cfg.algorithm
    micro = {
        "": f"algorithm.ppo_micro_batch_size_per_gpu={alg.ppo_micro_batch_size_per_gpu}",
        "critic": f"critic.ppo_micro_batch_size_per_gpu={cfg.critic.ppo_micro_batch_size_per_gpu}",
        "reward_model": f"reward_model.micro_batch_size_per_gpu={cfg.reward_model.micro_batch_size_per_gpu}",
    }[who]
    return (
        f"data.drop_last=false: the {num_prompts} training prompts leave a last batch of {rest}, whose "
        f"{rest * cfg.rollout.n} sequences do not split as a full batch's do ({replicas} rollout replicas, "
        f"{dp} data-parallel ranks x {mini_batches} mini-batches, micro-batches of {micro}); set "
        "data.drop_last=true or change the number of prompts"
    )


def batch_problems(cfg: RunConfig) -> list[str]:
    """Prompts split evenly over rollout replicas; sequences over DP ranks, mini- and micro-batches."""
    alg, n = cfg.algorithm, cfg.rollout.n
    dp = data_parallel_size(cfg)
    rollout_dp = rollout_replicas(cfg)
    if cfg.dpo.train_files:  # a DPO run has no rollout: the RL batch rules do not apply
        return dpo_batch_problems(cfg.dpo, dp)
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
    rm_micro = cfg.reward_model.micro_batch_size_per_gpu
    if cfg.reward_model.path is not None and (batch * n) % dp == 0 and not _splits(batch * n // dp, rm_micro):
        problems.append(
            f"reward_model.micro_batch_size_per_gpu={rm_micro} does not divide the {batch * n // dp} sequences "
            "per data-parallel rank the reward model scores (data.train_batch_size * rollout.n / DP)"
        )
    grouped = (
        AdvEstimator.GRPO,
        AdvEstimator.DR_GRPO,
        AdvEstimator.RLOO,
        AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE,
    )
    if cfg.algorithm.adv_estimator in grouped and n < 2:
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


def dpo_batch_problems(dpo: DPOConfig, dp: int) -> list[str]:
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


def critic_problems(cfg: RunConfig) -> list[str]:
    """A colocated critic shares the actor's processes (so its layout); its micro-batches split evenly."""
    critic, problems = cfg.critic, []
    if critic.colocate and critic.parallel is not None and critic.parallel != cfg.parallel:
        problems.append(
            "critic.parallel differs from parallel, but critic.colocate=true runs the critic in the actor's "
            "processes (same layout): drop critic.parallel or set it equal"
        )
    if cfg.algorithm.adv_estimator != AdvEstimator.GAE:
        return problems
    alg = cfg.algorithm
    world, par = _critic_ranks(cfg)
    if world % model_copy_ranks(par):
        sizes = "TP*PP*CP" if par.context_parallel_size > 1 else "TP*PP"
        return [
            *problems,
            f"critic.parallel: {sizes} = {model_copy_ranks(par)} does not divide the critic's {world} ranks "
            "(critic.num_ranks)",
        ]
    dp = world // model_copy_ranks(par)
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
