"""Make megatron-core 0.16.1 run on a CPU-only torch build (gloo, fp32/bf16, local layer spec).

megatron-core assumes CUDA in a handful of places. Each patch below names the failure it fixes; all of them
are applied by :func:`apply`, which is a no-op when CUDA is available, so GPU runs use megatron untouched.
``tests/compat/test_megatron_cpu.py`` has one test per patched behaviour; the patches target
:data:`TARGET_MEGATRON_VERSION` and :func:`apply` warns on any other version.

Scope, narrowest first:

1. Megatron's own functions, replaced in place: the CUDA RNG state helpers and ``CudaRNGStatesTracker.add``
   (they read ``torch.cuda.get_rng_state``), the torch-norm wrapper that refuses sequence parallelism (it
   now builds our fused RMSNorm), the rotary embedding and fused SwiGLU that attention and the MLP call
   (versions with fewer passes, ``compat.cpu_layers``), the selection of a context-parallel rank's rotary
   angles (its index is built in pinned memory), the DistributedOptimizer loader that trips on
   torch AdamW's ``step`` entry, and the parameter gather and grad reduce-scatter of a one-rank optimizer
   group (self-copies that slowed every later GEMM of the process).
2. ``torch.cuda.current_device`` and ``torch.cuda.synchronize``: megatron calls them in ~40 places (buffer
   allocation, SP gathers, p2p). On a CPU-only build both can only raise, so answering "cpu" / doing
   nothing changes no behaviour that worked before.
3. :class:`MegatronCudaToCpuMode`, a ``TorchFunctionMode``, for hard-coded ``device="cuda"``, ``.cuda()``,
   ``.to("cuda")`` and ``Tensor.type() == "torch.cuda.FloatTensor"`` checks inside megatron (schedules,
   DDP buffers, optimizer, grad clipping, checkpointing). It rewrites a call only when the calling frame
   is megatron's code; the same call from anywhere else (ours, a user's, torch's) is left alone.
4. The GEMMs of megatron's linear layers (:func:`_patch_linear_gemm`): on CPUs where oneDNN's fp32 GEMM beats
   ATen's (``ops.gemm``: AVX-512 CPUs not made by Intel, 2.0-2.4x there), the ``torch.matmul`` products of
   their autograd Functions (forward and input gradient) run on ``ops.gemm`` and the fused weight-gradient
   accumulation on ``ops.gemm_into``; elsewhere they stay ATen's. The rollout's multi-token forwards use the
   same GEMM, so its recompute stays bitwise megatron's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mcore_rl.ops import gemm

TARGET_MEGATRON_VERSION = "0.16.1"

_state: dict[str, Any] = {"applied": False, "mode": None}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _called_from_megatron() -> bool:
    """True when the nearest caller outside torch and this module is megatron code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return name.startswith("megatron.")
        frame = frame.f_back  # type: ignore[assignment]
    return False


_TENSOR_CUDA, _TENSOR_TYPE, _TENSOR_TO = torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to
_TENSOR_MATMUL = torch.Tensor.matmul


class MegatronCudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements requested by megatron code to the CPU; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and func is not _TENSOR_CUDA and func is not _TENSOR_TYPE and func is not _TENSOR_TO:
            # Nothing to rewrite (no device keyword, no placement method): the ~2,000 other calls of a
            # training step take this path, each paying the mode's dispatch.
            return func(*args)
        kwargs = kwargs or {}
        if func is _TENSOR_CUDA:
            if _called_from_megatron():
                return args[0]
        elif func is _TENSOR_TYPE:
            if len(args) == 1 and not kwargs and _called_from_megatron():
                name = func(*args)
                # megatron whitelists 'torch.cuda.FloatTensor' & co. for optimizer params and grads.
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        elif func is _TENSOR_TO:
            if len(args) > 1 and _is_cuda_device(args[1]) and _called_from_megatron():
                args = (args[0], "cpu", *args[2:])
            elif _is_cuda_device(kwargs.get("device")) and _called_from_megatron():
                kwargs = {**kwargs, "device": "cpu"}
        elif _is_cuda_device(kwargs.get("device")) and _called_from_megatron():
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self: Any, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on the CPU generator, with megatron's duplicate checks."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    original = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(original)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    mrandom.CudaRNGStatesTracker.add = _cpu_tracker_add


def _sequence_parallel_torch_norm(
    cls: Any,
    config: Any,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
) -> torch.nn.Module:
    """``WrappedTorchNorm`` without its sequence-parallel refusal, and with our fused RMSNorm (same
    ``weight``, fewer passes over the activations: ``compat.cpu_layers``).

    The norm is elementwise over the hidden dim, so it is correct on a sequence shard; its weight grads are
    partial sums per rank, which megatron's ``finalize_model_grads`` all-reduces over TP for every param
    tagged ``sequence_parallel``.
    """
    from mcore_rl.compat.cpu_layers import FusedRMSNorm

    if zero_centered_gamma:
        raise ValueError("zero_centered_gamma is not supported by the torch norm on CPU")
    norm_cls = FusedRMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    module = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
    for param in module.parameters():
        param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
    return module


def _patch_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    torch_norm.WrappedTorchNorm.__new__ = _sequence_parallel_torch_norm


def _patch_fused_blocks() -> None:
    """Fewer elementwise passes for rotary embeddings and SwiGLU (``compat.cpu_layers``, other cases
    unchanged). megatron's unfused rotary is ~8 passes per call and as many in backward; its fused SwiGLU
    (``bias_activation_fusion``, which our configs turn on) is ``torch.compile``d. ``SelfAttention`` and
    ``MLP`` call them through their own modules' globals, which are the ones replaced."""
    from megatron.core.transformer import attention, mlp

    from mcore_rl.compat import cpu_layers

    if not hasattr(attention.apply_rotary_pos_emb, "_mcore_rl_original"):
        attention.apply_rotary_pos_emb = cpu_layers.apply_rotary_pos_emb(attention.apply_rotary_pos_emb)
    if not hasattr(mlp.bias_swiglu_impl, "_mcore_rl_original"):
        mlp.bias_swiglu_impl = cpu_layers.bias_swiglu_impl(mlp.bias_swiglu_impl)


def _patch_context_parallel_rope() -> None:
    """Under context parallelism megatron's rotary embedding keeps the angles of this CP rank's two chunks
    with an index built in pinned memory, which a CPU-only torch refuses ("pin_memory=True requires a CUDA or
    other accelerator backend"); the same selection without it (``compat/context_attention.py``)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    from mcore_rl.compat.context_attention import pos_emb_on_this_cp_rank

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank


def _patch_single_rank_grad_reduce() -> None:
    """With one rank in its distributed-optimizer group, megatron's grad reduce-scatter copies every bucket
    onto itself (15 MB per step for the 4M-param bench model, on gloo's worker thread: see
    :func:`_patch_single_rank_param_gather` for what that thread costs the GEMMs). Only that exact case,
    synchronous, output being the input's own memory, is skipped."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    reduce_scatter = buffers.dist_reduce_scatter_func
    if hasattr(reduce_scatter, "_mcore_rl_original"):
        return

    def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if (
            group is not None
            and not kwargs.get("async_op", False)
            and torch.distributed.get_world_size(group) == 1
            and output.data_ptr() == input.data_ptr()
            and output.numel() == input.numel()
        ):
            return None
        return reduce_scatter(output, input, *args, **kwargs)

    call._mcore_rl_original = reduce_scatter  # type: ignore[attr-defined]
    buffers.dist_reduce_scatter_func = call


def _patch_distopt_step_entry() -> None:
    """torch AdamW keeps a per-param ``step`` that the fully_reshardable loader does not expect."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_mcore_rl_patched", False):
        return

    def set_states_keeping_step(self: Any, model_param: Any, tensors: Any) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    set_states_keeping_step._mcore_rl_patched = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keeping_step


def _patch_single_rank_param_gather() -> None:
    """With one rank in its distributed-optimizer group, megatron's parameter "all-gather" after each step
    copies every bucket onto itself. On gloo that copy runs on the process group's worker thread, and from
    then on every small 2-thread GEMM in the process took twice as long (54 -> 110 us for
    [32,256]x[256,768]; issue 17): libgomp stops spinning between parallel regions once it manages more
    threads than there are cores. Skipping the self-copy changes nothing else."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    original = _ParamAndGradBucketGroup.start_param_sync
    if getattr(original, "_mcore_rl_patched", False):
        return

    def start_param_sync(self: Any, force_sync: bool = False) -> None:
        if self.intra_distributed_optimizer_instance_size != 1:
            original(self, force_sync)
            return
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
        self.param_gather_handle = None
        self.param_gather_dispatched = True

    start_param_sync._mcore_rl_patched = True  # type: ignore[attr-defined]
    _ParamAndGradBucketGroup.start_param_sync = start_param_sync


class _CpuWeightGradAccumulation:
    """The two entries of apex's ``fused_weight_gradient_mlp_cuda`` that megatron's linear layers call under
    ``gradient_accumulation_fusion``: ``main_grad += grad_output^T @ input`` as one GEMM into the DDP grad
    buffer. Without it every linear's weight gradient is a fresh [out, in] tensor that DDP's hook then adds
    into the buffer: an extra allocation and two extra passes over every weight per step."""

    @staticmethod
    def wgrad_gemm_accum_fp32(
        total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
    ) -> None:
        gemm.gemm_into(main_grad, grad_output.t(), total_input, accumulate=True)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32  # the same GEMM: addmm_ keeps main_grad's dtype


def _patch_wgrad_accumulation() -> None:
    """Give megatron's linear layers a CPU ``fused_weight_gradient_mlp_cuda`` (see
    :class:`_CpuWeightGradAccumulation`); :func:`fuse_weight_grad_accumulation` switches a model onto it."""
    from megatron.core.tensor_parallel import layers

    if not isinstance(getattr(layers, "fused_weight_gradient_mlp_cuda", None), type):
        layers.fused_weight_gradient_mlp_cuda = _CpuWeightGradAccumulation


class _GemmMode(TorchFunctionMode):
    """Inside a megatron linear's forward or backward: its 2-D-weight fp32 ``matmul`` products on ``ops.gemm``
    (a mode, not a copy of megatron's Functions: their communication and gradient bookkeeping stay theirs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.matmul or func is _TENSOR_MATMUL) and not kwargs and _plain_product(*args):
            a, b = args
            return gemm.gemm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])
        return func(*args, **(kwargs or {}))


def _plain_product(*args: Any) -> bool:
    """An fp32 ``a`` [..., K] x ``b`` [K, N] that autograd does not record (the op has no derivative)."""
    if len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in args):
        return False
    a, b = args
    tracked = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    return b.dim() == 2 and a.dim() >= 2 and a.dtype == b.dtype == torch.float32 and not tracked


def _on_gemm(step: Any) -> Any:
    """``step`` (a Function's forward or backward) with its products on ``ops.gemm`` where oneDNN pays."""

    def run(ctx: Any, *args: Any) -> Any:
        if not gemm.onednn_pays(torch.device("cpu"), torch.float32):
            return step(ctx, *args)
        with _GemmMode():
            return step(ctx, *args)

    run._mcore_rl_patched = True  # type: ignore[attr-defined]
    return run


def _patch_linear_gemm() -> None:
    """Put the products of megatron's linear Functions (trainable and frozen weights) on ``ops.gemm``; the
    fused weight-gradient GEMM is :class:`_CpuWeightGradAccumulation`'s. Their backward runs where the
    autograd engine calls it, outside any mode entered around the step, hence a mode per call."""
    from megatron.core.tensor_parallel import layers

    for name in ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight"):
        function = getattr(layers, name, None)
        if function is None or getattr(function.backward, "_mcore_rl_patched", False):
            continue
        function.forward = staticmethod(_on_gemm(function.forward))
        function.backward = staticmethod(_on_gemm(function.backward))


def fuse_weight_grad_accumulation(chunks: list[Any]) -> int:
    """Switch the fp32 tensor-parallel linears of DDP-wrapped ``chunks`` to accumulate their weight gradient
    straight into DDP's ``main_grad`` (megatron's ``gradient_accumulation_fusion``, with the CPU GEMM of
    :class:`_CpuWeightGradAccumulation`). Only where the patches are active, and only for layers whose weight
    has a ``main_grad`` of its own dtype (megatron checks the flag at construction, so it is set on the
    built layers rather than in the config). Returns the number of layers switched."""
    if not _state["applied"]:
        return 0
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    switched = 0
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if (
                isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                and weight is not None
                and weight.dtype == torch.float32
                and getattr(weight, "main_grad", None) is not None
                and weight.main_grad.dtype == torch.float32
            ):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched


class _NoStream:
    """What megatron asks of ``torch.cuda.current_stream()`` (0.19+ on every gradient sync): waits that a
    CPU, with no streams, has nothing to do for."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _patch_torch_cuda_queries() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NoStream()  # type: ignore[assignment,return-value]


def _silence_known_warnings() -> None:
    """Benign on CPU and repeated every step: missing Apex/TE, gloo's deprecated collective names,
    megatron reading ``.grad`` of non-leaf tensors, and megatron's DDP buffer offload resizing
    ``Tensor.storage()`` (torch's TypedStorage deprecation, printed on the console of ``mcore-rl dpo``)."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*\\.grad attribute of a Tensor that is not a leaf.*")
    # The RNG tracker's fork checks that the CPU generator is untouched inside a "GPU" stream; here the
    # stream is the CPU generator (``_patch_rng``), so every dropout (LoRA's) logged it, wrongly.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


def apply() -> bool:
    """Apply every patch once per process when CUDA is absent. Returns True when patches are active."""
    if torch.cuda.is_available():
        return False
    if _state["applied"]:
        return True
    from mcore_rl.compat.megatron_import import import_megatron_core

    version = getattr(import_megatron_core(), "__version__", "unknown")
    if version != TARGET_MEGATRON_VERSION:
        warnings.warn(
            f"mcore_rl's CPU compatibility layer targets megatron-core {TARGET_MEGATRON_VERSION}, "
            f"found {version}; CPU runs may fail",
            stacklevel=2,
        )
    _silence_known_warnings()
    _patch_torch_cuda_queries()
    _patch_rng()
    _patch_torch_norm()
    _patch_fused_blocks()
    _patch_context_parallel_rope()
    _patch_single_rank_grad_reduce()
    _patch_distopt_step_entry()
    _patch_single_rank_param_gather()
    _patch_wgrad_accumulation()
    _patch_linear_gemm()
    from mcore_rl.compat import grad_reduce, moe

    grad_reduce.patch_bucket_group()  # DDP's all-reduce through a host reducer where a run gives one
    moe.patch_cpu_dispatcher()  # MoE: megatron's all-to-all dispatcher without its CUDA stream
    mode = MegatronCudaToCpuMode()
    mode.__enter__()
    _state.update(applied=True, mode=mode)
    return True


def is_applied() -> bool:
    return bool(_state["applied"])


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Temporarily leave the process-wide mode, for code that never calls megatron: every torch call made
    from Python passes through the mode's ``__torch_function__`` (2-3 us each), which cost the rollout's
    decode loop 8% of its time (issue 17). Also used by tests that check the unpatched behaviour. A no-op
    unless the mode is the innermost one of this thread: not applied (CUDA builds), another thread (the
    stack is per thread), or another mode entered above it."""
    mode = _state["mode"]
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()
