"""vLLM as the rollout engine on GPUs, in the same processes as the actor (the ``gpu`` extra, vLLM 0.33).

Never constructed on a GPU yet: the engine arguments, sampling parameters, parameter names and per-rank
shapes are checked against the real vLLM 0.33.0 package on CPU by ``make test-vllm`` (``tests_vllm/``); the
log-prob parity test is ``gpu``-marked and needs a CUDA machine with vLLM. The choices below follow a
line-by-line read of vLLM 0.33.0 (``shared/notes/gpu-paper-review.md``).

How it fits the hybrid engine:

- ``external_launcher`` makes vLLM join the torch.distributed world that already exists, one vLLM worker per
  rank. vLLM reads ``RANK`` and ``LOCAL_RANK`` from the environment, which only torchrun sets; we set them
  from the world when missing. ``data_parallel_size=1``: vLLM's own DP would make every ``generate`` a
  lockstep collective across all replicas (a replica that skips a call hangs the others); with 1, the other
  TP groups are vLLM's "external DP" and generate independently.
- vLLM's TP groups are consecutive ranks and it pads the vocab to 64, so the reshard plan must come from
  :func:`~mcore_rl.engine.rollout.vllm_layout.build_vllm_plan`. :meth:`load_weights` refuses a shard for the
  wrong TP rank or of the wrong shape, and :meth:`generate` refuses to run until every parameter has been
  loaded since construction or the last level-2 sleep (vLLM starts from dummy weights).
- vLLM checks at construction that ``gpu_memory_utilization`` of the *total* memory is free: build this
  engine before the training engine allocates. It is put to sleep (level 2) right after construction, so
  training starts with nothing of vLLM's resident; the lifecycle is ``wake_up`` -> ``load_weights`` ->
  ``generate`` -> ``sleep``. Sleep level 1 in vLLM *offloads the weights to pinned host memory* (a copy per
  step that the next load overwrites anyway); :func:`build_vllm_hybrid` therefore sleeps at level 2.
- Log-probs: our definition (``rollout/base.py``) is ``log_softmax(logits / T)`` over the whole vocab. We ask
  for ``processed_logprobs`` (after the temperature; vLLM's default ``raw_logprobs`` are taken before it),
  which equals our definition exactly when top-k and top-p are off (greedy requests get the raw logits'
  log-softmax, also ours). With filtering on, vLLM reports the truncated distribution's log-probs, which the
  actor cannot recompute, so :meth:`generate` refuses that unless ``truncated_logprobs_ok=True`` (the driver
  then recomputes old log-probs with the actor, as it does by default).
- Sampling is not broadcast between vLLM's TP ranks: they agree only because they draw alike. An unseeded
  request would draw its seed from each rank's own global RNG, so we draw one on the TP group's first rank and
  broadcast it. Temperatures vLLM would refuse or silently clamp are refused with our field's name.
- Side effects of construction on this process (vLLM's, not ours): the global torch/NumPy/``random`` RNGs
  are reseeded, fp32 matmul precision is set to "highest", and ``gc.freeze()`` runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    SamplingParams,
    SamplingParamsError,
)
from mcore_rl.engine.rollout.vllm_layout import (
    check_covered,
    check_shard_shapes,
    check_vllm_sampling,
    vllm_param_name,
)

if TYPE_CHECKING:
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.parallel.reshard.hybrid import HybridConfig, HybridEngine
    from mcore_rl.parallel.reshard.plan import ReshardPlan

__all__ = ["VLLMRolloutEngine", "build_vllm_hybrid", "engine_args", "vllm_param_name"]


def engine_args(
    config_dir: str,
    *,
    tensor_parallel_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    gpu_memory_utilization: float,
    seed: int,
    enforce_eager: bool,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` (also checked against vLLM's config validation by tests_vllm/)."""
    return dict(
        model=config_dir,
        skip_tokenizer_init=True,
        load_format="dummy",  # real weights arrive as shards through load_weights
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=1,  # other TP groups are independent "external DP" replicas
        distributed_executor_backend="external_launcher",
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=True,
        enforce_eager=enforce_eager,
        seed=seed,
        logprobs_mode="processed_logprobs",
    )


def set_launcher_env(rank: int, local_rank: int) -> None:
    """vLLM's external launcher reads ``RANK`` and ``LOCAL_RANK``; set them when no launcher did."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))


def check_free_memory(free: int, total: int, utilization: float) -> None:
    """vLLM refuses to start unless ``utilization * total`` bytes are free; say so with our field's name."""
    if free < utilization * total:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks vLLM for {utilization * total / 2**30:.1f} GiB but only "
            f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are free: build VLLMRolloutEngine before the "
            f"training engine, or lower gpu_memory_utilization below {free / total:.2f}"
        )


def shared_seed(seed: int | None, group: dist.ProcessGroup | None) -> int:
    """The request's seed; a missing one is drawn on the group's first rank and broadcast to the others."""
    if seed is not None:
        return seed
    value = torch.randint(0, 2**62, (1,))
    if group is not None:
        dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value)


class VLLMRolloutEngine:
    """:class:`~mcore_rl.engine.rollout.base.RolloutEngine` backed by an in-process vLLM ``LLM``."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        tensor_parallel_size: int,
        tp_group: dist.ProcessGroup | None = None,
        expected_tp_rank: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        enforce_eager: bool = False,
        truncated_logprobs_ok: bool = False,
    ) -> None:
        """``tp_group``: this rank's rollout TP group (ours, for the seed broadcast; None at TP 1).
        ``expected_tp_rank``: the plan's rollout TP coordinate of this rank (``plan.rollout_coords[rank][0]``),
        checked against vLLM's on every load; None takes ``rank % tensor_parallel_size``, vLLM's order."""
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(
                "the vLLM rollout engine needs the 'gpu' extra: pip install 'mcore_rl[gpu]'"
            ) from err
        if not dist.is_initialized():
            raise RuntimeError("initialise the ParallelContext first: vLLM joins its torch.distributed world")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tensor_parallel_size:
            raise ValueError(
                f"rollout tensor_parallel_size={tensor_parallel_size} must divide world_size={world}"
            )
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings} (vLLM refuses it)"
            )
        self.arch = arch
        self.max_model_len = max_model_len
        self.tp_group = tp_group
        self.expected_tp_rank = rank % tensor_parallel_size if expected_tp_rank is None else expected_tp_rank
        self.truncated_logprobs_ok = truncated_logprobs_ok
        set_launcher_env(rank, torch.cuda.current_device())
        check_free_memory(*torch.cuda.mem_get_info(), gpu_memory_utilization)
        self._config_dir = tempfile.mkdtemp(prefix="mcore_rl_vllm_")
        with open(os.path.join(self._config_dir, "config.json"), "w") as f:
            json.dump(arch.extra, f)
        self.llm = LLM(
            **engine_args(
                self._config_dir,
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                enforce_eager=enforce_eager,
            )
        )
        self._all_params: frozenset[str] = frozenset(self.llm.apply_model(_param_names)[0])
        self._unloaded = set(self._all_params)
        self.sleep(level=2)  # nothing resident while the training engine is built and trains first

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: wake_up() and load_weights() first")
        check_covered(self._unloaded)
        check_vllm_sampling(params)
        filtered = not params.greedy and (0 < params.top_k < self.arch.vocab_size or params.top_p < 1.0)
        if filtered and not self.truncated_logprobs_ok:
            raise SamplingParamsError(
                f"top_k={params.top_k} / top_p={params.top_p}: vLLM reports log-probs of the filtered "
                "distribution, which the actor cannot recompute; turn filtering off, use the local engine, or "
                "build VLLMRolloutEngine(truncated_logprobs_ok=True) and recompute old log-probs with the actor"
            )
        for i, prompt in enumerate(prompts):
            if len(prompt) + params.max_new_tokens > self.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens exceed max_model_len")
        vllm_params = VLLMSamplingParams(**sampling_kwargs(params, shared_seed(params.seed, self.tp_group)))
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], vllm_params, use_tqdm=False
        )
        return _to_generation_output(outputs, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy rollout-layout shards into vLLM's parameters; each must match vLLM's name and shape exactly."""
        shards = {vllm_param_name(name): tensor for name, tensor in named_tensors}
        expected = self.expected_tp_rank
        self.llm.apply_model(lambda model: _copy_shards(model, shards, expected))
        self._unloaded -= set(shards)
        self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused

    def sleep(self, level: int = 1) -> None:
        """vLLM's levels: 1 offloads the weights to host memory and drops the KV cache; 2 drops both."""
        self.llm.sleep(level=level)
        if level == 2:
            self._unloaded = set(self._all_params)
        self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.llm.wake_up(tags=list(tags) if tags is not None else None)
        self.asleep = False

    def close(self) -> None:
        """Stop vLLM's engine core before the process group is destroyed (else NCCL reports errors at exit)."""
        self.llm.llm_engine.engine_core.shutdown()


def sampling_kwargs(params: SamplingParams, seed: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for ours (also round-tripped by tests_vllm/)."""
    return dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # only our stop ids end a sequence
        logprobs=0,  # the sampled token's log-prob
        seed=seed,
    )


def build_vllm_hybrid(
    engine: TrainEngine,
    rollout: VLLMRolloutEngine,
    plan: ReshardPlan,
    ctx: ParallelContext,
    config: HybridConfig | None = None,
) -> HybridEngine:
    """The hybrid engine over a vLLM rollout engine built (before ``engine``) for ``plan``, which must come
    from ``build_vllm_plan``. vLLM sleeps at level 2: every switch to rollout reloads all weights anyway."""
    from mcore_rl.engine.rollout.from_megatron import rollout_tensors
    from mcore_rl.engine.weights import local_parameters
    from mcore_rl.parallel.reshard.hybrid import HybridConfig, HybridEngine

    if rollout.expected_tp_rank != plan.rollout_coords[dist.get_rank()][0]:
        raise ValueError("plan: its rollout coordinates are not vLLM's; build it with build_vllm_plan")
    arch = engine.arch
    return HybridEngine(
        engine,
        rollout,
        plan,
        local_params=lambda: dict(local_parameters(engine.models, arch, ctx)),
        to_rollout_tensors=lambda shards: rollout_tensors(shards, arch),
        config=replace(config or HybridConfig(), sleep_level=2),
        ctx=ctx,
    )


def _param_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


@torch.no_grad()
def _copy_shards(model: torch.nn.Module, shards: dict[str, torch.Tensor], expected_tp_rank: int) -> None:
    params = dict(model.named_parameters())
    check_shard_shapes(
        {name: tuple(p.shape) for name, p in params.items()},
        {name: tuple(t.shape) for name, t in shards.items()},
        tp_rank=_tp_rank(),
        expected=expected_tp_rank,
    )
    for name, shard in shards.items():
        params[name].copy_(shard, non_blocking=True)


def _to_generation_output(outputs: list[Any], params: SamplingParams) -> GenerationOutput:
    rows = [(i, completion) for i, request in enumerate(outputs) for completion in request.outputs]
    num, width = len(rows), params.max_new_tokens
    token_ids = torch.full((num, width), params.pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(num, width)
    lengths = torch.zeros(num, dtype=torch.long)
    reasons = []
    for row, (_, completion) in enumerate(rows):
        ids = list(completion.token_ids)[:width]
        token_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[row, : len(ids)] = torch.tensor(
            [step[token].logprob for step, token in zip(completion.logprobs, ids, strict=False)]
        )
        lengths[row] = len(ids)
        reasons.append(FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH)
    prompt_index = torch.tensor([i for i, _ in rows], dtype=torch.long)
    return GenerationOutput(prompt_index, token_ids, log_probs, lengths, reasons)
