"""The driver's typed handle on the hybrid workers: whole batches in, whole batches out.

Each method splits its batch by the layout it runs in (rollout replicas for ``generate``, training DP
ranks for ``log_probs`` and ``update``), sends each shard once, and joins the owners' results in shard order
(``controller/dispatch.py``). Two backends run the same worker code: :class:`RayBackend` (a worker group of
Ray actors, any layout) and :class:`InProcessBackend` (one rank inside the driver process: the baseline the
Ray overhead is measured against, and fast tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.controller.backend import Backend
from mcore_rl.controller.dispatch import (
    concat_records,
    data_owners,
    num_dp_shards,
    num_rollout_shards,
    rollout_owners,
    split_record,
)
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.token_batching import balanced_order, row_lengths, select_rows
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.rollout.batch import common_width
from mcore_rl.engine.workers.losses import PolicyLossSettings
from mcore_rl.engine.workers.memory import max_over_ranks
from mcore_rl.types import (
    LogProbBatch,
    OnPolicyUpdate,
    RolloutBatch,
    RolloutRequest,
    SFTBatch,
    TrainBatch,
    UpdateStats,
)


@dataclass(frozen=True)
class UpdatePlan:
    """How one step's batch becomes optimizer steps."""

    num_mini_batches: int
    """Optimizer steps per epoch (train batch / PPO mini-batch, in prompts)."""
    ppo_epochs: int
    micro_batch_size: int
    """Sequences per forward/backward on one data-parallel rank."""
    on_nonfinite: str = "stop"
    """stop (raise, naming the step) or skip the update of a NaN/inf loss."""
    token_budget: int | None = None
    """Tokens per micro-batch (``algorithm.ppo_max_token_len_per_gpu``): rows balanced over data-parallel
    ranks by tokens, micro-batches by the budget, trimmed; None: ``micro_batch_size`` rows."""
    balance_group_size: int | None = None
    """Without a token budget: groups of this many consecutive rows (one prompt's samples) dealt to the
    data-parallel ranks by tokens (``trainer.balance_batch``) where each rank's share of a mini-batch is whole
    groups; None: the batch's order."""


def balances_groups(rows: int, num_mini_batches: int, num_dp_ranks: int, group_size: int | None) -> bool:
    """Whether ``trainer.balance_batch`` deals an update's prompt groups to the data-parallel ranks: more than
    one rank, and every rank's share of a mini-batch whole groups of ``group_size`` rows (None: off)."""
    return (
        group_size is not None
        and num_dp_ranks > 1
        and rows % (num_mini_batches * num_dp_ranks * group_size) == 0
    )


def submit_rollout(
    backend: Backend, request: RolloutRequest, params: SamplingParams
) -> Callable[[], RolloutBatch]:
    """Start ``generate`` on every rank of ``backend`` with the prompts split over its rollout replicas; the
    returned callable waits and joins the replicas' samples in prompt order (the actor's colocated engines
    and a rollout pool alike)."""
    infos = backend.infos
    shards = split_record(request, num_rollout_shards(infos))
    wait = backend.submit("generate", list(shards), "rollout", params)
    owners = rollout_owners(infos)

    def collect() -> RolloutBatch:
        results = wait()
        return concat_records(common_width([results[i] for i in owners], params.pad_token_id))

    return collect


class ActorGroup:
    """Actor + reference + rollout engines over a backend; see the module docstring."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        infos = backend.infos
        self.num_rollout_shards = num_rollout_shards(infos)
        self.num_dp_shards = num_dp_shards(infos)
        self._data_owners = data_owners(infos)

    def sync_weights(self) -> dict[str, float]:
        """Actor weights -> rollout engines (the hybrid engine's reshard); rank 0's timings."""
        return self.submit_sync_weights()()

    def submit_sync_weights(self) -> Callable[[], dict[str, float]]:
        """Start :meth:`sync_weights` (it runs after every call submitted before it); call the result to wait."""
        wait = self.backend.submit("sync_weights", None, "")
        return lambda: dict(wait()[0])

    def generate(self, request: RolloutRequest, params: SamplingParams) -> RolloutBatch:
        """Prompts split over rollout replicas; samples back in prompt order."""
        return submit_rollout(self.backend, request, params)()

    def submit_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int
    ) -> Callable[[], LogProbBatch]:
        """Start the actor/reference log-prob pass (the driver scores meanwhile); call the result to wait."""
        shards = list(split_record(batch, self.num_dp_shards))
        micro = min(micro_batch_size, shards[0].num_sequences)
        wait = self.backend.submit("log_probs", shards, "dp", temperature, micro)

        def collect() -> LogProbBatch:
            results = wait()
            return concat_records([results[i] for i in self._data_owners])

        return collect

    def submit_ref_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int
    ) -> Callable[[], torch.Tensor]:
        """Start the reference's log-prob pass alone (the on-policy shortcut with the KL loss); call the
        result to wait for the [N, S] log-probs."""
        shards = list(split_record(batch, self.num_dp_shards))
        micro = min(micro_batch_size, shards[0].num_sequences)
        wait = self.backend.submit("ref_log_probs", shards, "dp", temperature, micro)

        def collect() -> torch.Tensor:
            results = wait()
            return torch.cat([results[i] for i in self._data_owners])

        return collect

    def update(self, batch: TrainBatch, settings: PolicyLossSettings, plan: UpdatePlan) -> UpdateStats:
        """One step's actor update; the stats of data-parallel rank 0's owner (already DP-reduced)."""
        return self.submit_update(batch, settings, plan)()

    def submit_update(
        self, batch: TrainBatch, settings: PolicyLossSettings, plan: UpdatePlan
    ) -> Callable[[], UpdateStats]:
        """Start :meth:`update`; call the result to wait."""
        shards, _ = self._update_shards(batch, plan)
        rows_per_mini_batch = shards[0].tokens.shape[0] // plan.num_mini_batches
        micro = min(plan.micro_batch_size, max(rows_per_mini_batch, 1))
        args = (settings, plan.num_mini_batches, plan.ppo_epochs, micro, plan.on_nonfinite, plan.token_budget)
        wait = self.backend.submit("update", shards, "dp", *args)

        def collect() -> UpdateStats:
            stats: UpdateStats = wait()[self._data_owners[0]]
            return stats

        return collect

    def update_on_policy(
        self, batch: TrainBatch, settings: PolicyLossSettings, plan: UpdatePlan
    ) -> OnPolicyUpdate:
        """One optimizer step whose old log-probs are its own forward's (``batch.old_log_probs`` is not read;
        ``plan`` must be one mini-batch, one epoch): the stats of data-parallel rank 0's owner and the
        forward's [N, S] actor log-probs, the owners' shards joined back into ``batch``'s row order."""
        return self.submit_update_on_policy(batch, settings, plan)()

    def submit_update_on_policy(
        self, batch: TrainBatch, settings: PolicyLossSettings, plan: UpdatePlan
    ) -> Callable[[], OnPolicyUpdate]:
        """Start :meth:`update_on_policy`; call the result to wait."""
        if plan.num_mini_batches != 1 or plan.ppo_epochs != 1:
            raise ValueError(
                f"update_on_policy: one optimizer step only, got {plan.num_mini_batches} mini-batches x "
                f"{plan.ppo_epochs} epochs"
            )
        shards, order = self._update_shards(batch, plan)
        micro = min(plan.micro_batch_size, max(shards[0].tokens.shape[0], 1))
        args = (settings, micro, plan.on_nonfinite, plan.token_budget)
        wait = self.backend.submit("update_on_policy", shards, "dp", *args)

        def collect() -> OnPolicyUpdate:
            results = wait()
            owned: list[OnPolicyUpdate] = [results[i] for i in self._data_owners]
            log_probs = torch.cat([r.actor_log_probs for r in owned])
            if order is not None:  # row j of the shards is the batch's row order[j]
                log_probs = log_probs[torch.argsort(torch.as_tensor(order))]
            return OnPolicyUpdate(owned[0].stats, log_probs)

        return collect

    def _update_shards(
        self, batch: TrainBatch, plan: UpdatePlan
    ) -> tuple[list[TrainBatch], list[int] | None]:
        """The data-parallel shards of an update, and where they were balanced the row order they were cut from
        (the same mini-batches, rows or prompt groups dealt to the ranks by tokens)."""
        if plan.token_budget is not None:
            group = 1
        elif balances_groups(
            batch.tokens.shape[0], plan.num_mini_batches, self.num_dp_shards, plan.balance_group_size
        ):
            group = plan.balance_group_size or 1
        else:
            return list(split_record(batch, self.num_dp_shards)), None
        lengths = row_lengths(batch.response_mask).tolist()
        order = balanced_order(lengths, plan.num_mini_batches, self.num_dp_shards, group)
        return list(split_record(select_rows(batch, order), self.num_dp_shards)), order

    def set_optim(self, optim: OptimConfig, total_optimizer_steps: int) -> None:
        """New optimizer hyper-parameters and LR schedule, same optimizer state (SFT -> RL)."""
        self.backend.submit("set_optim", None, "", optim, total_optimizer_steps)()

    def reset_reference(self) -> None:
        """The reference policy (KL terms) becomes the actor as it is now: where RL starts after SFT."""
        self.backend.submit("reset_reference", None, "")()

    def sft_update(self, batch: SFTBatch, micro_batch_size: int) -> dict[str, float]:
        """One supervised step on ``batch`` split over data-parallel ranks; DP-global loss and grad norm."""
        shards = list(split_record(batch, self.num_dp_shards))
        micro = min(micro_batch_size, shards[0].tokens.shape[0])
        results = self.backend.submit("sft_update", shards, "dp", micro)()
        return dict(results[self._data_owners[0]])

    def save_checkpoint(self, directory: str, step: int, extra: dict[str, Any]) -> None:
        self.backend.submit("save_checkpoint", None, "", directory, step, extra)()

    def load_checkpoint(self, directory: str) -> tuple[int, dict[str, Any]]:
        step, extra = self.backend.submit("load_checkpoint", None, "", directory)()[0]
        return int(step), dict(extra)

    def phase_memory(self) -> dict[str, float]:
        """Peak memory per phase since the last call, the maximum over ranks (``trainer/memory.py``)."""
        return self.submit_phase_memory()()

    def submit_phase_memory(self) -> Callable[[], dict[str, float]]:
        """Start :meth:`phase_memory`; call the result to wait."""
        wait = self.backend.submit("take_phase_memory", None, "")
        return lambda: max_over_ranks(wait())

    def save_model(self, directory: str, assets: tuple[str | None, str | None] = (None, None)) -> None:
        """The actor's weights as a model checkpoint (``TrainEngine.save_model``; loadable at any layout) with
        the tokenizer and generation files of ``assets`` (``ModelConfig.asset_folders``)."""
        self.backend.submit("save_model", None, "", directory, assets)()

    def save_lora_adapter(self, directory: str, base_model: str | None) -> None:
        """The actor's LoRA adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        self.backend.submit("save_lora_adapter", None, "", directory, base_model)()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the ranks: ``graceful`` lets them leave their world first, else they are killed at once."""
        self.backend.shutdown(graceful=graceful)
