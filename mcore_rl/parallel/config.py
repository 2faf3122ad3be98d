"""The settings of the parallel layer: the ``parallel`` section (how the training ranks are split, in
megatron-core's names) and ``rollout.hybrid`` (how the 3D-HybridEngine switches those ranks between training
and rollout). Pure: no torch, so the run config loads without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mcore_rl.io.fields import OPTIONAL_POSITIVE, POSITIVE, check_section, one_of
from mcore_rl.parallel.layout import ParallelLayout


@dataclass
class ParallelConfig:
    """How the training ranks are split. The world size comes from the launcher (torchrun, Ray, Slurm)."""

    SECTION: ClassVar[str] = "parallel"

    tensor_model_parallel_size: int = 1
    """Ranks that split every weight matrix (megatron TP). Keep within one node."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are split into."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per stage (interleaved 1F1B); None disables interleaving. Needs pipeline size >= 2."""
    sequence_parallel: bool = False
    """Split norm/dropout activations by sequence over the TP group (needs TP >= 2)."""
    context_parallel_size: int = 1
    """Ranks every sequence is split over (megatron CP, for long responses): each holds 2 of ``2 x CP`` equal
    chunks of every row (chunks r and 2CP-1-r, megatron's load balancing) and attention exchanges keys and
    values among them; they hold the same weights (gradients are reduced over DP x CP) and read the same rows.
    Rows are padded to a multiple of 2 x CP (x TP with sequence_parallel). Must divide world / (TP x PP);
    not with mixture-of-experts models or ``model.share_prompt_prefix``."""
    expert_model_parallel_size: int = 1
    """Mixture-of-experts models: ranks the experts of each MoE layer are split over (megatron EP). EP is
    folded into data parallelism: EP ranks hold the same attention weights and different data and experts;
    ``expert_tensor_parallel_size * expert_model_parallel_size`` must divide ``world / pipeline size``."""
    expert_tensor_parallel_size: int | None = None
    """Ranks each expert's matrices are split over (megatron ETP); None = the tensor-parallel size."""
    data_parallel_size: int | None = None
    """Replicas; None derives it (world size / (TP * CP * PP)). When set it must equal the derived value."""
    backend: str | None = None
    """torch.distributed backend: nccl or gloo; None picks nccl with CUDA and gloo without."""
    timeout_minutes: int = 30
    """Collective timeout before a hung rank fails the job."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "tensor_model_parallel_size": POSITIVE,
                "pipeline_model_parallel_size": POSITIVE,
                "context_parallel_size": POSITIVE,
                "virtual_pipeline_model_parallel_size": OPTIONAL_POSITIVE,
                "expert_model_parallel_size": POSITIVE,
                "expert_tensor_parallel_size": OPTIONAL_POSITIVE,
                "data_parallel_size": OPTIONAL_POSITIVE,
                "backend": one_of(None, "nccl", "gloo"),
                "timeout_minutes": POSITIVE,
            },
        )

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(
            world_size=world_size,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size,
            sp=self.sequence_parallel,
            ep=self.expert_model_parallel_size,
            etp=self.expert_tensor_parallel_size,
            cp=self.context_parallel_size,
        )


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class HybridConfig:
    """Memory handling of the train <-> rollout switch (``parallel/reshard/hybrid.py``; ``rollout.hybrid``)."""

    SECTION: ClassVar[str] = "rollout.hybrid"

    offload_optimizer: bool = True
    """Move optimizer state to host memory during rollout (GPU only; a no-op on CPU)."""
    offload_grad_buffers: bool = True
    """Free the DDP gradient buffers during rollout; they are re-allocated (zeroed) for training."""
    sleep_level: int = 1
    """Rollout sleep between phases: 1 frees the KV cache and moves the embedded engine's weights to host
    memory, 2 also drops the weights. The colocated vLLM engine always sleeps at 2 (every step's sync rewrites
    all of its weights, so there is nothing to keep): on a GPU no level leaves rollout weights there."""
    bucket_bytes: int = 256 << 20
    """Largest p2p message during resharding (a single larger unit, e.g. one huge row, still goes whole)."""
    max_inflight_bytes: int | None = None
    """Most bytes a rank sends plus receives per reshard round, i.e. its peak extra memory during the
    reshard (None: ``2 * bucket_bytes``). A single message larger than this goes alone in its round."""
    rollout_dtype: str | None = None
    """Cast weights to this dtype (float32, bfloat16, float16) while resharding; None keeps the train dtype."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "sleep_level": one_of(1, 2),
                "bucket_bytes": POSITIVE,
                "max_inflight_bytes": OPTIONAL_POSITIVE,
                "rollout_dtype": one_of(None, *ROLLOUT_DTYPES),
            },
        )
