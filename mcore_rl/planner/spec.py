"""What the planner is asked: a model, a training layout, a batch, a rollout setup and a GPU.

Everything here is checked before any memory is computed, so a run that cannot start (a head count the
tensor-parallel size does not divide, a batch that does not split over DP ranks and micro-batches) fails
with one line naming the field instead of a stack trace on the cluster an hour later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.lora_spec import TARGETS, moe_targets_problem
from mcore_rl.engine.rollout.layout import RolloutLayoutError, check_rollout_tp
from mcore_rl.io.errors import InputError
from mcore_rl.parallel.layout import LayoutError, ParallelLayout

GIB = 1 << 30
MIB = 1 << 20

GPU_MEMORY_BYTES = {
    "A100-40": 40960 * MIB,
    "A100-80": 81920 * MIB,
    "H100-80": 81559 * MIB,
    "H200-141": 143771 * MIB,
}
"""Device memory as ``nvidia-smi`` reports it (MiB), per GPU model the planner knows."""

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")

ROLLOUT_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each dtype the weight sync can cast to (``HybridConfig.rollout_dtype``)."""


class PlanError(InputError):
    """An input the run cannot start with; the message names the field."""


LORA_ALL_LINEAR = tuple(TARGETS)


@dataclass(frozen=True)
class PlanInput:
    """One run to size: every field the memory formulas read."""

    arch: ModelArch
    """Model shapes (from the HF ``config.json``)."""
    gpu: str
    """GPU model, a key of :data:`GPU_MEMORY_BYTES` (e.g. 'A100-80')."""
    world_size: int
    """GPUs in the job; training and rollout are colocated on all of them."""
    tp: int = 1
    """Training tensor-parallel size."""
    pp: int = 1
    """Training pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline chunks per stage (interleaved 1F1B); None = no interleaving."""
    sp: bool = False
    """Sequence parallelism over the TP group (needs tp >= 2; a mixture-of-experts model with tp >= 2 needs it)."""
    ep: int = 1
    """Expert-parallel size (``parallel.expert_model_parallel_size``): each MoE layer's experts split over
    this many ranks, folded into DP; must divide the experts."""
    etp: int | None = None
    """Expert tensor-parallel size (``parallel.expert_tensor_parallel_size``); None = ``tp``. ``etp * ep``
    must divide the ``tp * dp`` ranks of a pipeline stage."""
    cp: int = 1
    """Context-parallel size (``parallel.context_parallel_size``): every sequence split over this many ranks,
    which hold the same weights (the optimizer shards over DP x CP); must divide ``world / (tp * pp)``, and
    ``2 * cp`` (times ``tp`` with SP) must divide ``seq_length``."""
    cp_comm: Literal["p2p", "all_gather"] = "p2p"
    """How CP ranks exchange keys and values (megatron's ``cp_comm_type``): 'p2p', TE's ring (GPUs), keeps
    only this rank's K and V for backward; 'all_gather' (our local-spec attention on CPU,
    ``compat/context_attention.py``, and TE's for sliding windows) keeps every token's K and V of a layer."""
    seq_length: int = 2048
    """Longest training sequence (prompt + response) in tokens."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one DP rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all DP ranks (prompts x samples per prompt in RL)."""
    recompute: Recompute = "none"
    """Activation recomputation: 'none', 'selective' (attention scores) or 'full' (each layer's input only)."""
    flash_attention: bool = True
    """Fused attention that never stores the s x s scores (TE on GPU); False = megatron's local spec (CPU)."""
    bf16: bool = True
    """bf16 weights with fp32 main params in the optimizer; False = fp32 throughout."""
    use_distributed_optimizer: bool = True
    """Shard fp32 main params and Adam moments over the DP ranks (ZeRO-1), as TrainEngine does by default."""
    critic: bool = False
    """A critic of the same shape (value head) colocated and trained on the same GPUs (PPO)."""
    reference: bool = False
    """A frozen reference policy colocated in the training dtype (KL penalty); with LoRA it is the base with
    the adapters off and holds nothing of its own."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the frozen actor (``model.lora_rank``; 0: full fine-tune): gradients and
    optimizer state for the adapters only (``planner/lora.py``)."""
    lora_targets: tuple[str, ...] = LORA_ALL_LINEAR
    """The adapted HF projections of every decoder layer (``model.target_modules``)."""
    keep_logits_bytes: int = 0
    """Logits of one micro-batch the LM head's forward keeps for its backward (``model.keep_logits_gib``; none
    on a GPU unless set): whole vocab chunks, each one GEMM the backward skips."""
    rollout_tp: int = 1
    """Rollout tensor-parallel size (the rollout engine's own layout)."""
    rollout_memory_fraction: float = 0.5
    """Share of total GPU memory the rollout engine reserves for its weights, activations and KV cache
    (vLLM's ``gpu_memory_utilization``, a fraction of the total)."""
    rollout_dtype: str | None = None
    """The dtype the weight sync casts the weights to (``rollout.hybrid.rollout_dtype``), in which the rollout
    engine then holds its weights and KV cache and computes; None: no cast, the training dtype. Any value is
    taken as a cast, so set it only when it differs from the training dtype (a cast makes every resharded
    shard a new tensor, ``memory.reshard_output_bytes``)."""
    rollout_max_batched_tokens: int = 8192
    """Tokens in one rollout forward pass (vLLM ``max_num_batched_tokens``); sizes its activation peak."""
    rollout_max_num_seqs: int = 256
    """Sequences decoded at once (vLLM ``max_num_seqs``); sizes the sampler's full-vocab logits."""
    offload_optimizer: bool = True
    """Optimizer state leaves the GPU during rollout (HybridConfig.offload_optimizer)."""
    offload_grad_buffers: bool = True
    """Gradient buffers are freed during rollout (HybridConfig.offload_grad_buffers)."""
    reshard_inflight_bytes: int = 512 * MIB
    """Most bytes one rank sends plus receives per reshard round (HybridConfig: 2 x bucket_bytes)."""
    reserved_bytes: int = 3 * GIB
    """Held back from every GPU for the CUDA context, NCCL buffers and allocator fragmentation."""
    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism is kept inside one node."""

    def __post_init__(self) -> None:
        if self.gpu not in GPU_MEMORY_BYTES:
            raise PlanError(f"gpu={self.gpu!r} is not known; use one of {sorted(GPU_MEMORY_BYTES)}")
        if self.cp_comm not in ("p2p", "all_gather"):
            raise PlanError(f"cp_comm={self.cp_comm!r} must be 'p2p' or 'all_gather'")
        if self.recompute not in RECOMPUTE_MODES:
            raise PlanError(f"recompute={self.recompute!r} must be one of {RECOMPUTE_MODES}")
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "rollout_tp", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rollout_max_batched_tokens", "rollout_max_num_seqs", "reshard_inflight_bytes"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.rollout_memory_fraction < 1:
            raise PlanError(f"rollout_memory_fraction must be in (0, 1), got {self.rollout_memory_fraction}")
        if self.rollout_dtype is not None and self.rollout_dtype not in ROLLOUT_DTYPE_BYTES:
            raise PlanError(
                f"rollout_dtype={self.rollout_dtype!r} must be None or one of {sorted(ROLLOUT_DTYPE_BYTES)}"
            )
        if self.reserved_bytes < 0:
            raise PlanError(f"reserved_bytes must be >= 0, got {self.reserved_bytes}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise PlanError(f"lora_rank must be an integer >= 0, got {self.lora_rank!r}")
        if self.lora_rank and (not self.lora_targets or set(self.lora_targets) - set(LORA_ALL_LINEAR)):
            raise PlanError(
                f"lora_targets={list(self.lora_targets)!r}: choose some of {list(LORA_ALL_LINEAR)}"
            )
        if isinstance(self.keep_logits_bytes, bool) or not isinstance(self.keep_logits_bytes, int):
            raise PlanError(f"keep_logits_bytes must be an integer >= 0, got {self.keep_logits_bytes!r}")
        if self.keep_logits_bytes < 0:
            raise PlanError(f"keep_logits_bytes must be an integer >= 0, got {self.keep_logits_bytes!r}")
        if self.lora_rank and self.arch.moe is not None:
            problem = moe_targets_problem(self.lora_targets, "lora_targets")
            if problem is not None:
                raise PlanError(problem)

    @property
    def layout(self) -> ParallelLayout:
        """The training layout (raises :class:`PlanError` naming the field when it is impossible)."""
        try:
            return ParallelLayout(
                self.world_size,
                tp=self.tp,
                pp=self.pp,
                vpp=self.vpp,
                sp=self.sp,
                ep=self.ep,
                etp=self.etp,
                cp=self.cp,
            )
        except LayoutError as err:
            raise PlanError(str(err)) from None

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards the dense state over: megatron's data-parallel group with
        context parallelism, DP x CP (CP ranks hold the same weights)."""
        return self.layout.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: ranks holding the same expert shard, over which the distributed
        optimizer shards the experts' state (``world / (etp * ep * pp)``)."""
        return self.layout.expert_dp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank per optimizer step (valid after :meth:`validate`)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def gpu_bytes(self) -> int:
        return GPU_MEMORY_BYTES[self.gpu]

    @property
    def rollout_element_bytes(self) -> int:
        """Bytes per element of the rollout engine's weights, KV cache and activations."""
        if self.rollout_dtype is None:
            return 2 if self.bf16 else 4
        return ROLLOUT_DTYPE_BYTES[self.rollout_dtype]

    def with_layout(self, **changes: object) -> PlanInput:
        return replace(self, **changes)  # type: ignore[arg-type]

    def validate(self) -> None:
        """Every divisibility rule a launch needs; raises :class:`PlanError` naming the field."""
        layout, moe = self.layout, self.arch.moe
        try:
            layout.check_model(
                num_attention_heads=self.arch.num_attention_heads,
                num_query_groups=self.arch.num_query_groups,
                num_layers=self.arch.num_layers,
                vocab_size=self.arch.vocab_size,
                seq_length=self.seq_length,
                num_experts=moe.num_experts if moe else None,
                moe_ffn_hidden_size=moe.ffn_hidden_size if moe else None,
            )
            check_rollout_tp(self.arch, self.rollout_tp)
        except (LayoutError, RolloutLayoutError) as err:
            raise PlanError(str(err)) from None
        if moe is not None and moe.ffn_hidden_size % self.rollout_tp:
            # vLLM without expert parallelism splits every expert's intermediate over its TP ranks
            raise PlanError(
                f"moe_intermediate_size={moe.ffn_hidden_size} is not divisible by the rollout "
                f"tensor_model_parallel_size={self.rollout_tp}"
            )
        if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
            raise PlanError(
                f"tensor_model_parallel_size={self.tp} must divide gpus_per_node={self.gpus_per_node} "
                "(a TP group must stay inside one node's NVLink domain)"
            )
        if self.world_size % self.rollout_tp:
            raise PlanError(f"world_size={self.world_size} is not divisible by rollout_tp={self.rollout_tp}")
        if self.rollout_tp > self.gpus_per_node or self.gpus_per_node % self.rollout_tp:
            raise PlanError(f"rollout_tp={self.rollout_tp} must divide gpus_per_node={self.gpus_per_node}")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise PlanError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size*dp={self.micro_batch_size}*{self.dp}"
            )
        if self.vpp is not None and self.num_microbatches % self.pp:
            raise PlanError(
                f"micro-batches per step={self.num_microbatches} (global_batch_size/(micro_batch_size*dp)) "
                f"must be a multiple of pipeline_model_parallel_size={self.pp} with interleaving (megatron's rule)"
            )
        if self.seq_length > self.arch.max_position_embeddings:
            raise PlanError(
                f"seq_length={self.seq_length} exceeds the model's "
                f"max_position_embeddings={self.arch.max_position_embeddings}"
            )
