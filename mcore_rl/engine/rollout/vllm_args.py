"""What we hand vLLM: the engine's settings (:class:`VLLMRolloutConfig`), ``vllm.LLM``'s keyword arguments
built from them, a request's ``vllm.SamplingParams`` keyword arguments, and what the process must hold
before construction (the launcher's environment, free GPU memory).

Plain functions of our settings, apart from the engine (``vllm_engine.py``), so that ``tests_vllm/`` checks
them against vLLM's own argument parsing without building one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.engine.rollout import vllm_compat
from mcore_rl.engine.rollout.base import SamplingParams

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class VLLMRolloutConfig:
    """Settings of :class:`~mcore_rl.engine.rollout.vllm_engine.VLLMRolloutEngine` (sampling settings travel
    with each call instead)."""

    dtype: torch.dtype = torch.bfloat16
    """Weights, activations and KV cache dtype inside vLLM (log-probs come back fp32)."""
    max_model_len: int = 4096
    """Longest prompt + response in tokens; at most the model's ``max_position_embeddings``."""
    kv_cache_memory_bytes: int | None = None
    """KV cache per rank, in bytes. None: ``gpu_memory_utilization`` on GPU; 512 MiB on CPU, where a
    utilization would be a fraction of host RAM."""
    gpu_memory_utilization: float = 0.5
    """GPU only, when ``kv_cache_memory_bytes`` is None: fraction of the device for weights plus KV cache."""
    seed: int = 0
    """vLLM's engine seed (its dummy weights and the draws of requests without one; ours always have one)."""
    enforce_eager: bool | None = None
    """True: no compilation or CUDA graphs. None: eager on CPU (compiling costs ~40 s at start and is not
    faster for small models), graphs on GPU."""
    truncated_logprobs_ok: bool = False
    """Allow top-k / top-p, whose log-probs the actor cannot recompute (then recompute old log-probs)."""
    block_size: int | None = None
    """KV-cache block size in tokens; the prefix cache reuses whole blocks only, so a multi-turn rollout of
    short conversations reuses more with smaller blocks. None: vLLM's (128 on CPU, 16 on GPU)."""
    record_routing: bool | None = None
    """Mixture-of-experts models: ``generate`` returns the experts each token was routed to (``prompt_experts`` /
    ``response_experts``: the routing-agreement metric, router replay), where this build can record them (CPU;
    see ``vllm_outputs``). None: where it can; True: required (construction refuses, saying why); False: off."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive or None, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive or None, got {self.block_size}")


def engine_args(config_dir: str, config: VLLMRolloutConfig, tensor_parallel_size: int) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` on this platform (checked against vLLM's config by tests_vllm/)."""
    on_cpu = vllm_compat.platform_name() == "cpu"
    return dict(
        model=config_dir,
        skip_tokenizer_init=True,
        load_format="dummy",  # real weights arrive as shards through load_weights
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=1,  # other TP groups are independent "external DP" replicas
        distributed_executor_backend="external_launcher",
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        enable_sleep_mode=vllm_compat.sleep_mode_available(),
        enforce_eager=on_cpu if config.enforce_eager is None else config.enforce_eager,
        seed=config.seed,
        logprobs_mode="processed_logprobs",
        # multi-turn rollouts resend each conversation's whole context every turn (token in, token out): the
        # prefix cache finds what it computed before (vLLM's default where supported; said, not assumed)
        enable_prefix_caching=True,
        **({} if config.block_size is None else {"block_size": config.block_size}),
        **vllm_compat.memory_args(config.kv_cache_memory_bytes, config.gpu_memory_utilization),
        **vllm_compat.platform_args(),
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


def sampling_kwargs(params: SamplingParams, seed: int, whole_prompts: bool = False) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for ours (also round-tripped by tests_vllm/); ``whole_prompts``:
    computed from the first token, never read from the prefix cache."""
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
        **({"skip_reading_prefix_cache": True} if whole_prompts else {}),
    )
