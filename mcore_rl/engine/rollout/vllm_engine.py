"""vLLM as the rollout engine on GPUs, in the same processes as the actor (the ``gpu`` extra).

UNVERIFIED: vLLM cannot be installed on the CPU machines this project is built and tested on; this module is
written against vLLM's public API of the V1 engine, v0.11 and later (``LLM(distributed_executor_backend=
"external_launcher")``, ``LLM.sleep/wake_up(tags=...)``, ``LLM.apply_model``, ``logprobs_mode``, added in
0.10.2) and is exercised only by ``gpu``-marked tests.

How it fits the hybrid engine:

- ``external_launcher`` makes vLLM join the torch.distributed world that torchrun (or our Ray workers) already
  built, one vLLM worker per rank, so rollout TP groups are consecutive ranks. Build the reshard plan with
  ``build_plan(..., consecutive_rollout_ranks=True)`` and ``rollout_vocab_divisible_by=64 // tp_g`` (vLLM pads the
  vocab to a multiple of 64 before splitting it).
- The model is created with ``load_format="dummy"``; weights arrive from the reshard plan already sharded in
  vLLM's own per-rank layout (fused ``qkv_proj`` = [q; k; v] shards, ``gate_up_proj`` = [gate; up] shards), so
  :meth:`load_weights` copies each shard straight into vLLM's parameter. No rank ever builds a full tensor
  (``model.load_weights`` would need full HF tensors and shard them again).
- Log-probs: our definition (``rollout/base.py``) is ``log_softmax(logits / T)`` over the whole vocab. vLLM's
  ``raw_logprobs`` (its default) are taken before the temperature, and its ``processed_logprobs`` after the
  temperature *and* after top-k / top-p have set the filtered logits to -inf. We ask for
  ``processed_logprobs``, which equals our definition exactly when top-k and top-p are off (greedy requests
  get the raw logits' log-softmax, also our definition). With filtering on, vLLM's numbers are the truncated
  distribution's (higher by ``-log(kept probability mass)``), which the actor cannot recompute, so
  :meth:`VLLMRolloutEngine.generate` refuses that combination unless the engine was built with
  ``truncated_logprobs_ok=True`` (then the driver must recompute old log-probs with the actor, as it does by
  default).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

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


def vllm_param_name(rollout_name: str) -> str:
    """Our rollout-layout name -> vLLM's parameter name (Llama/Qwen2/Mistral share one layout)."""
    return rollout_name if rollout_name.startswith("lm_head") else f"model.{rollout_name}"


class VLLMRolloutEngine:
    """:class:`~mcore_rl.engine.rollout.base.RolloutEngine` backed by an in-process vLLM ``LLM``."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        tensor_parallel_size: int,
        dtype: torch.dtype = torch.bfloat16,
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        enforce_eager: bool = False,
        truncated_logprobs_ok: bool = False,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(
                "the vLLM rollout engine needs the 'gpu' extra: pip install 'mcore_rl[gpu]'"
            ) from err
        if not dist.is_initialized():
            raise RuntimeError("initialise the ParallelContext first: vLLM joins its torch.distributed world")
        world = dist.get_world_size()
        if world % tensor_parallel_size:
            raise ValueError(
                f"rollout tensor_parallel_size={tensor_parallel_size} must divide world_size={world}"
            )
        self.arch = arch
        self.truncated_logprobs_ok = truncated_logprobs_ok
        self._config_dir = tempfile.mkdtemp(prefix="mcore_rl_vllm_")
        with open(os.path.join(self._config_dir, "config.json"), "w") as f:
            json.dump(arch.extra, f)
        self.llm = LLM(
            model=self._config_dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=world // tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
        )
        self.asleep = False

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        filtered = not params.greedy and (0 < params.top_k < self.arch.vocab_size or params.top_p < 1.0)
        if filtered and not self.truncated_logprobs_ok:
            raise SamplingParamsError(
                f"top_k={params.top_k} / top_p={params.top_p}: vLLM reports log-probs of the filtered "
                "distribution, which the actor cannot recompute; turn filtering off, use the local engine, or "
                "build VLLMRolloutEngine(truncated_logprobs_ok=True) and recompute old log-probs with the actor"
            )

        vllm_params = VLLMSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # only our stop ids end a sequence
            logprobs=0,  # the sampled token's log-prob
            seed=params.seed,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], vllm_params, use_tqdm=False
        )
        return _to_generation_output(outputs, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        shards = {vllm_param_name(name): tensor for name, tensor in named_tensors}
        missing = self.llm.apply_model(lambda model: _copy_shards(model, shards))
        if any(missing):
            raise KeyError(f"vLLM model has no parameters named {sorted(set().union(*missing))}")

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.llm.wake_up(tags=list(tags) if tags is not None else None)
        self.asleep = False


@torch.no_grad()
def _copy_shards(model: torch.nn.Module, shards: dict[str, torch.Tensor]) -> set[str]:
    params = dict(model.named_parameters())
    for name, shard in shards.items():
        if name not in params:
            continue
        target = params[name]
        rows = min(target.shape[0], shard.shape[0])  # vocab padding rows may differ; padding stays zero
        target[:rows].copy_(shard[:rows], non_blocking=True)
        target[rows:].zero_()
    return set(shards) - set(params)


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
