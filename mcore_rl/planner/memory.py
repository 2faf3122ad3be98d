"""Per-GPU memory of a colocated RL run in its three phases: train, rollout, and the switch between them.

Weights, gradients and optimizer state per parameter (megatron's ``theoretical_memory_usage``, the table in
its ``dist_optimizer.md``; ``d`` = DP size), as :class:`~mcore_rl.engine.train_engine.TrainEngine` builds
them (gradients reduced in fp32; ``d`` is DP x CP with context parallelism, megatron's data-parallel group
"with context parallel")::

    bf16:  2 (weights) + 4 (fp32 grads) + 12 / d (fp32 main params + Adam m, v)   = 6 + 12/d
    fp32:  4 (weights) + 4 (grads)      +  8 / d (Adam m, v; the weights are the main params)

(without the distributed optimizer ``d`` is 1). A mixture-of-experts model's experts follow the same table
with the expert-data-parallel size ``edp = world / (etp * ep * pp)`` in place of ``d`` (megatron keeps them in
their own grad buffers and optimizer, sharded over the expert-DP group), and are reported apart: ``weights``,
``gradients`` and ``optimizer`` are then the dense parameters' (attention, norms, routers, embeddings, dense
MLP layers), ``expert weights``, ``expert gradients`` and ``expert optimizer`` the ``E / ep`` experts of each
MoE layer that this rank holds, each split over ETP (``params.py``).

The phases follow the hybrid engine's state machine (``mcore_rl.parallel.reshard.hybrid``):

    train    actor (and critic) weights + grads + optimizer, reference weights, activations, LM head;
             never the rollout's weights: the colocated vLLM engine sleeps at level 2 (every step's sync
             rewrites all its weights, so it keeps none), the embedded engine at level 1 moves them to host
             memory and at level 2 drops them; for MoE also the experts' activations, the routers' tensors and the dispatcher's buffers
             (``moe.py``)
    switch   train -> rollout after offloading the actor's optimizer / grad buffers: what training keeps +
             the rollout engine's weights being filled + the reshard's new output shards, alive until the
             load has copied them in (:func:`reshard_output_bytes`) + the reshard round's in-flight messages
             (freed before the engine's weights wake: the sum is an upper bound by the smaller of the two)
    rollout  what training leaves on the GPU + the rollout engine's reservation, a fixed fraction of the
             total (vLLM ``gpu_memory_utilization``): its weights, its activation peak, the KV cache

Only the actor's gradients and optimizer state leave the GPU for the rollout (the hybrid engine holds the
actor's training engine alone); a colocated critic keeps all of its state through the switch and the rollout.
The rollout engine holds its weights, KV cache and activations in ``rollout_dtype`` (the weight sync's cast),
else the training dtype.

The rollout engine (vLLM, without expert parallelism) holds every expert on every rollout TP rank, each
split over the rollout TP: for an MoE model its weights are not the training rank's, and the reshard moves
each training rank's experts to every rollout rank that needs a slice of them.

Each phase must fit ``GPU memory - reserved_bytes``; the run needs ``max`` over the phases, not their sum.
Each term is taken at its own worst pipeline stage (weights at the most loaded one, activations at the
first, the LM head at the last), so with PP > 1 the train total is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mcore_rl.engine.params import (
    active_params,
    layer_split,
    model_params,
    rank_split,
    router_params,
    stage_split,
)
from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.planner.activations import activation_terms, lm_head_bytes
from mcore_rl.planner.lora import stage_adapter_params, stage_merged_params
from mcore_rl.planner.moe import dispatcher_bytes, rollout_mlp_token_bytes, rollout_weight_numel
from mcore_rl.planner.spec import PlanInput


@dataclass(frozen=True)
class TrainState:
    """One trained model's static bytes on one GPU (its most loaded pipeline stage). Each total includes the
    rank's experts; the ``expert_*`` fields are their part (0 for a dense model)."""

    params: int
    """Parameters this rank holds."""
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    expert_params: int = 0
    """Of :attr:`params`, the experts' (``E / ep`` per MoE layer, each split over ETP)."""
    expert_weights_bytes: int = 0
    expert_grads_bytes: int = 0
    expert_optimizer_bytes: int = 0
    """The experts' fp32 main params and moments, sharded over the expert-data-parallel ranks."""
    adapter_params: int = 0
    """Of :attr:`params`, the LoRA adapters' (the only ones trained; 0 without LoRA)."""


def train_state(plan: PlanInput, value_head: bool = False) -> TrainState:
    _, split = rank_split(plan.arch, plan.layout, value_head)
    dense_shards, expert_shards = (
        (plan.optimizer_shards, plan.expert_dp) if plan.use_distributed_optimizer else (1, 1)
    )
    if plan.lora_rank and not value_head:  # the critic is never LoRA-adapted
        return lora_train_state(plan, dense_shards)
    weight_size = 2 if plan.bf16 else 4
    optimizer_per_param = 12 if plan.bf16 else 8  # fp32 main params (bf16 only) + Adam's two moments
    expert_optimizer = math.ceil(optimizer_per_param * split.expert / expert_shards)
    return TrainState(
        params=split.total,
        weights_bytes=weight_size * split.total,
        grads_bytes=4 * split.total,
        optimizer_bytes=math.ceil(optimizer_per_param * split.dense / dense_shards) + expert_optimizer,
        expert_params=split.expert,
        expert_weights_bytes=weight_size * split.expert,
        expert_grads_bytes=4 * split.expert,
        expert_optimizer_bytes=expert_optimizer,
    )


def lora_train_state(plan: PlanInput, shards: int) -> TrainState:
    """The actor with LoRA (``planner/lora.py``): the frozen base's weights and the adapters, whose alone are
    the gradients and optimizer state (sharded over ``shards`` ranks); at the stage holding the most of both.
    A mixture-of-experts model's experts are part of the frozen base (LoRA adapts its attention), reported
    apart as their weights only."""
    layout, arch = plan.layout, plan.arch

    def held(stage: int) -> tuple[int, int, int]:
        split = stage_split(arch, layout, stage)
        return (
            split.total,
            stage_adapter_params(arch, layout, stage, plan.lora_rank, plan.lora_targets),
            split.expert,
        )

    base, adapters, experts = max((held(stage) for stage in range(layout.pp)), key=lambda h: h[0] + h[1])
    weight_size = 2 if plan.bf16 else 4
    return TrainState(
        params=base + adapters,
        weights_bytes=weight_size * (base + adapters),
        grads_bytes=4 * adapters,
        optimizer_bytes=math.ceil((12 if plan.bf16 else 8) * adapters / shards),
        expert_params=experts,
        expert_weights_bytes=weight_size * experts,
        adapter_params=adapters,
    )


def merged_params(plan: PlanInput) -> int:
    """The base weights with adapters on one rank of the most loaded stage (merged for the weight sync)."""
    layout, arch = plan.layout, plan.arch
    return max(stage_merged_params(arch, layout, s, plan.lora_targets) for s in range(layout.pp))


def rollout_weight_bytes(plan: PlanInput) -> int:
    """One rollout TP rank's weights in the rollout layout and dtype (``rollout_dtype``, else the training
    dtype); for an MoE model all experts, each split over the rollout TP (``moe.rollout_weight_numel``)."""
    return rollout_weight_numel(plan.arch, plan.rollout_tp) * plan.rollout_element_bytes


def reshard_output_bytes(plan: PlanInput) -> int:
    """The new tensors among the rollout shards the reshard returns on one rank (``executor.execute_plan``):
    the hybrid engine holds them, beside the rollout engine's woken weights, until ``load_weights`` has copied
    them in. A shard is the training tensor itself only where the rank keeps it whole in the rollout's shape
    and dtype: no ``rollout_dtype`` cast, the parameter on the rank's pipeline stage, and the same shard at
    both TP sizes: every replicated one (norms, routers), the TP-split ones at rollout TP = training TP, the
    experts without EP at rollout TP = expert TP, and a vocab table only without padding rows (the copy skips
    them, so the last TP rank's padded table is never copied whole: ``128 x TP`` must divide the vocab).
    Every other shard is allocated; the rank keeping the least is taken."""
    total = rollout_weight_bytes(plan)
    if plan.rollout_dtype is not None:  # a cast writes every shard anew
        return total
    aliased = min(_aliased_numel(plan, stage) for stage in range(plan.pp))
    return total - aliased * plan.rollout_element_bytes


def _aliased_numel(plan: PlanInput, stage: int) -> int:
    """Parameters a rank of pipeline stage ``stage`` (its last TP rank) hands over as the rollout shards
    themselves, without a cast (:func:`reshard_output_bytes`)."""
    arch, layout = plan.arch, plan.layout
    same_tp = plan.rollout_tp == layout.tp
    whole_experts = layout.ep == 1 and layout.expert_tp == plan.rollout_tp
    replicated = 2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_norm else 0)  # norms, Qwen3's q/k norms
    numel = 0
    for chunk in layout.stage_layers(arch.num_layers)[stage]:
        for layer in chunk:
            split = layer_split(arch, layer, layout)
            router = router_params(arch) if arch.moe is not None and arch.is_moe_layer(layer) else 0
            numel += split.dense if same_tp else replicated + router
            numel += split.expert if whole_experts else 0
    unpadded = padded_vocab_size(arch.vocab_size, layout.tp, VOCAB_DIVISIBLE_BY) == arch.vocab_size
    table = arch.vocab_size * arch.hidden_size // layout.tp if same_tp and unpadded else 0
    if stage == 0:
        numel += table
    if stage == layout.pp - 1:
        numel += arch.hidden_size  # final norm
        if not arch.tie_word_embeddings:  # a tied model's last-stage copy is not a rollout tensor
            numel += table
    return numel


def kv_bytes_per_token(plan: PlanInput) -> int:
    """K and V of every layer for one token on one rollout TP rank: ``2 L (kv_heads / tp) head_dim e``."""
    arch = plan.arch
    return (
        2
        * arch.num_layers
        * arch.num_query_groups
        // plan.rollout_tp
        * arch.head_dim
        * plan.rollout_element_bytes
    )


def rollout_activation_bytes(plan: PlanInput) -> int:
    """Peak of one rollout forward over ``rollout_max_batched_tokens`` tokens (an estimate of what vLLM's
    profiling run measures): the residual stream, the norm output, the MLP's gate/up output and its
    activation, ``2h + 3f / tp`` per token (an MoE layer's fused-expert caches instead, ``moe.py``), plus the
    sampler's fp32 logits gathered to the full vocab for ``rollout_max_num_seqs`` sequences."""
    arch, rtp = plan.arch, plan.rollout_tp
    e = plan.rollout_element_bytes
    per_token = 2 * arch.hidden_size * e + rollout_mlp_token_bytes(plan)
    vocab = padded_vocab_size(arch.vocab_size, rtp, VOCAB_DIVISIBLE_BY)
    return plan.rollout_max_batched_tokens * per_token + 4 * plan.rollout_max_num_seqs * vocab


@dataclass(frozen=True)
class PhaseMemory:
    """The bytes one GPU needs in one phase, by term."""

    name: str
    terms: dict[str, int]
    """Term name -> bytes, in report order."""
    capacity_bytes: int
    """GPU memory minus the reserve."""

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def largest(self) -> str:
        return max(self.terms, key=lambda name: self.terms[name])


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer for one :class:`PlanInput`."""

    plan: PlanInput
    model_params: int
    """Whole-model parameter count (real vocab)."""
    active_params: int
    """Parameters one token uses (MoE: ``top_k`` of each layer's experts); ``model_params`` when dense."""
    actor: TrainState
    train: PhaseMemory
    switch: PhaseMemory
    rollout: PhaseMemory
    kv_bytes_per_token: int
    kv_cache_tokens: int
    """Tokens the rollout KV cache holds on one rollout TP rank (0 when its reservation is too small)."""
    problems: list[str] = field(default_factory=list)
    """Why the run does not fit, one line each; empty when it does."""

    @property
    def phases(self) -> tuple[PhaseMemory, ...]:
        return (self.train, self.switch, self.rollout)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak_bytes(self) -> int:
        return max(phase.total_bytes for phase in self.phases)

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes per GPU (every phase has the same)."""
        return self.train.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        """Usable bytes left free at the peak phase (negative when it does not fit)."""
        return self.capacity_bytes - self.peak_bytes


def _training_state_terms(
    plan: PlanInput,
) -> tuple[dict[str, int], dict[str, int], dict[str, int], TrainState]:
    """(weights of every colocated model, the actor's grads and optimizer state, the critic's, the actor's
    state)."""
    actor = train_state(plan)
    critic = train_state(plan, value_head=True) if plan.critic else None
    weights: dict[str, int] = {"weights": actor.weights_bytes - actor.expert_weights_bytes}
    state = {
        "gradients": actor.grads_bytes - actor.expert_grads_bytes,
        "optimizer": actor.optimizer_bytes - actor.expert_optimizer_bytes,
    }
    if plan.arch.moe is not None:
        weights["expert weights"] = actor.expert_weights_bytes
        state.update(
            {"expert gradients": actor.expert_grads_bytes, "expert optimizer": actor.expert_optimizer_bytes}
        )
    critic_state: dict[str, int] = {}
    if critic:
        weights["critic weights"] = critic.weights_bytes
        critic_state = {"critic gradients": critic.grads_bytes, "critic optimizer": critic.optimizer_bytes}
    if plan.reference and not plan.lora_rank:  # with LoRA the reference is the base, adapters off
        weights["reference weights"] = actor.weights_bytes
    return weights, state, critic_state, actor


def _problems(plan: PlanInput, phases: tuple[PhaseMemory, ...], kv_tokens: int) -> list[str]:
    problems = [
        f"{phase.name} phase needs {gib(phase.total_bytes)} > {gib(phase.capacity_bytes)} usable on {plan.gpu} "
        f"(largest term: {phase.largest})"
        for phase in phases
        if not phase.fits
    ]
    if kv_tokens < plan.seq_length:
        problems.append(
            f"rollout KV cache holds {kv_tokens} tokens < seq_length={plan.seq_length}: raise "
            f"rollout_memory_fraction={plan.rollout_memory_fraction} or rollout_tp={plan.rollout_tp}"
        )
    return problems


def plan_memory(plan: PlanInput) -> MemoryPlan:
    """Validate ``plan`` (see :meth:`PlanInput.validate`) and size every phase."""
    plan.validate()
    capacity = plan.gpu_bytes - plan.reserved_bytes
    weights, actor_state, critic_state, actor = _training_state_terms(plan)
    rollout_weights = rollout_weight_bytes(plan)
    # What stays on the GPU once the hybrid engine has offloaded training state for the rollout: it offloads
    # the actor's alone (HybridEngine._offload), a colocated critic is a training engine of its own.
    kept = dict(weights)
    for name, size in actor_state.items():
        offloaded = plan.offload_optimizer if "optimizer" in name else plan.offload_grad_buffers
        if not offloaded:
            kept[name] = size
    kept.update(critic_state)

    state = {**actor_state, **critic_state}
    train_terms = {**weights, **state, **activation_terms(plan), "LM head": lm_head_bytes(plan)}
    if plan.arch.moe is not None:
        train_terms["dispatcher buffers"] = dispatcher_bytes(plan)
    switch_terms = {**kept, "rollout weights": rollout_weights}
    new_shards = reshard_output_bytes(plan)
    if new_shards:  # 0 when every shard is a training tensor (same TP and dtype, no vocab padding)
        switch_terms["reshard output"] = new_shards
    # A round's messages hold real tensors: never more than this rank sends (its actor weights, experts
    # included, in the rollout dtype) plus receives (its rollout weights) in the whole sync, whatever the cap.
    sent = actor.params * plan.rollout_element_bytes
    switch_terms["reshard buffers"] = min(plan.reshard_inflight_bytes, sent + rollout_weights)
    if plan.lora_rank:  # the sync reads the adapted weights merged, each a new tensor (engine/lora.py)
        switch_terms["merged LoRA weights"] = (2 if plan.bf16 else 4) * merged_params(plan)
    rollout_act = rollout_activation_bytes(plan)
    kv = max(0, int(plan.rollout_memory_fraction * plan.gpu_bytes) - rollout_weights - rollout_act)
    rollout_terms = {
        **kept,
        "rollout weights": rollout_weights,
        "rollout activations": rollout_act,
        "kv cache": kv,
    }

    phases = tuple(
        PhaseMemory(name, terms, capacity)
        for name, terms in (("train", train_terms), ("switch", switch_terms), ("rollout", rollout_terms))
    )
    per_token = kv_bytes_per_token(plan)
    return MemoryPlan(
        plan=plan,
        model_params=model_params(plan.arch),
        active_params=active_params(plan.arch),
        actor=actor,
        train=phases[0],
        switch=phases[1],
        rollout=phases[2],
        kv_bytes_per_token=per_token,
        kv_cache_tokens=kv // per_token,
        problems=_problems(plan, phases, kv // per_token),
    )


def gib(num_bytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB (tiny models would all read 0.00 GiB)."""
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / (1 << 30):.2f} GiB"
