"""3D-HybridEngine on every layout: architecture features x train layouts (4 ranks) x rollout TP, generated.

For each case the rollout engine's per-token log-probs on its own samples must equal the actor's recomputed
log-probs (fp32, 1e-5), so the first PPO ratio is exactly 1; after a training step and a second switch the
rollout engine must follow the updated actor; and every reshard must receive exactly the bytes the plan says.

The cases are generated, not listed: every architecture variant (the base model, each feature alone, all
features at once) x every (tp, pp, vpp, sp) layout of 4 ranks x rollout TP 1, 2, 4, minus what the layout
math refuses (the same checks users hit). One ``run_distributed`` call per train layout runs all its cases
in one ParallelContext, so the sweep pays megatron's set-up once per layout. The default run takes the
all-features variant (tied embeddings included) on every layout; the full cross product is marked slow.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.rollout.base import SamplingParams
from mcore_rl.engine.rollout.layout import RolloutLayoutError, check_rollout_tp
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.ops import vocab_parallel_logprob_entropy
from mcore_rl.parallel.config import HybridConfig, ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.layout import LayoutError
from mcore_rl.parallel.reshard import arch_param_specs, rollout_coordinates
from mcore_rl.parallel.reshard.hybrid import Phase
from mcore_rl.parallel.sharding import ShardKind

WORLD = 4
TEMPERATURE = 0.9
ATOL = 1e-5
PROMPTS = [[5, 17, 33], [9, 2, 41, 77, 3], [120], [64, 65, 66, 67]]
ROLLOUT_TP = (1, 2, 4)

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,  # divisible by 128 x every TP: no padding rows
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}
FEATURES: dict[str, dict[str, Any]] = {
    "tied": {"tie_word_embeddings": True},
    "gqa": {"num_key_value_heads": 4},
    "qkv_bias": {"attention_bias": True},
    "odd_vocab": {"vocab_size": 250},  # padded differently at each TP degree
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,  # short enough that the scaling bites at these lengths
        }
    },
    "sliding_window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4},
    # after llama3_rope, so that ``all`` takes it: the same frequency tables, and YaRN's attention factor folded
    # into both engines' softmax scale besides (llama3 alone in the sweep; engine/rope.py)
    "yarn_rope": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    },
}


def arch_variants() -> dict[str, dict[str, Any]]:
    """HF configs: the base, each feature alone, and all features together (``all``, tied included)."""
    variants = {"base": dict(BASE)}
    variants.update({name: {**BASE, **overrides} for name, overrides in FEATURES.items()})
    variants["all"] = {k: v for overrides in FEATURES.values() for k, v in overrides.items()}
    variants["all"] = {**BASE, **variants["all"]}
    return variants


def train_layouts() -> dict[str, dict[str, Any]]:
    """Every ParallelConfig of ``WORLD`` ranks the layout math accepts (dp is what remains)."""
    out = {}
    for tp, pp, vpp, sp in itertools.product((1, 2, 4), (1, 2, 4), (None, 2), (False, True)):
        config = ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            sequence_parallel=sp,
        )
        try:
            layout = config.layout(WORLD)
        except LayoutError:
            continue
        name = f"tp{tp}-pp{pp}-dp{layout.dp}" + (f"-vpp{vpp}" if vpp else "") + ("-sp" if sp else "")
        out[name] = {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "sequence_parallel": sp,
        }
    return out


def _fits(arch: ModelArch, parallel: dict[str, Any], tp_g: int) -> bool:
    """The checks a user meets: megatron's split of the model, the rollout split, the reshard nesting."""
    layout = ParallelConfig(**parallel).layout(WORLD)
    try:
        layout.check_model(
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_query_groups,
            num_layers=arch.num_layers,
            vocab_size=arch.vocab_size,
        )
        check_rollout_tp(arch, tp_g)
        rollout_coordinates(layout, tp_g)
    except (LayoutError, RolloutLayoutError):
        return False
    return True


def cases() -> list[tuple[str, str, int]]:
    """(layout, arch variant, rollout tp) for every combination the layout math accepts."""
    archs = {name: ModelArch.from_hf_config(cfg) for name, cfg in arch_variants().items()}
    return [
        (layout, variant, tp_g)
        for layout, parallel in train_layouts().items()
        for variant, tp_g in itertools.product(archs, ROLLOUT_TP)
        if _fits(archs[variant], parallel, tp_g)
    ]


def default_cases(all_cases: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The default run's share: the all-features variant on every layout, one rollout TP per layout taken in
    turn (so each TP degree, and tp_g > tp > 1 under pipelining, is covered within the time budget)."""
    out = []
    for index, layout in enumerate(train_layouts()):
        accepted = [tp_g for lay, v, tp_g in all_cases if lay == layout and v == "all"]
        if accepted:
            out.append(
                (layout, "all", ROLLOUT_TP[index % len(ROLLOUT_TP)] if len(accepted) == 3 else accepted[0])
            )
    return out


def by_layout(selected: list[tuple[str, str, int]]) -> list[tuple[str, list[tuple[str, int]]]]:
    """Cases grouped per train layout: one ``run_distributed`` call (one ParallelContext) each."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for layout, variant, tp_g in selected:
        groups.setdefault(layout, []).append((variant, tp_g))
    return list(groups.items())


def _full_state(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """A random full state, identical on every rank (norm weights near 1 so activations stay tame)."""
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for spec in arch_param_specs(arch):
        noise = torch.randn(spec.shape, generator=gen)
        replicated_vector = spec.kind is ShardKind.REPLICATED and len(spec.shape) == 1
        full[spec.name] = 1.0 + 0.1 * noise if replicated_vector and "norm" in spec.name else 0.05 * noise
    return full


def _padded_tokens(sequences: list[list[int]], multiple: int) -> torch.Tensor:
    length = max(len(s) for s in sequences)
    length = -(-length // multiple) * multiple  # sequence parallelism splits the sequence over TP
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(seq)
    return tokens


def actor_log_probs(
    engine: TrainEngine, ctx: ParallelContext, out: Any, vocab_size: int
) -> torch.Tensor | None:
    """The actor's log p(response token) for the rollout ``out``: [N, max_new] on the last stage, else None."""
    sequences = [PROMPTS[int(i)] + r for i, r in zip(out.prompt_index, out.responses(), strict=True)]
    tokens = _padded_tokens(sequences, ctx.tp_size if ctx.layout.sp else 1)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shard = logits.shape[-1]
        targets = torch.roll(mb.tokens, -1, 1).clamp(max=vocab_size - 1)
        logp, _ = vocab_parallel_logprob_entropy(
            logits.float().reshape(-1, shard),
            targets.reshape(-1),
            vocab_start=ctx.tp_rank * shard,
            vocab_size=vocab_size,
            temperature=TEMPERATURE,
            tp_group=ctx.tp_group if ctx.tp_size > 1 else None,
        )
        return logits.sum() * 0, {"logp": logp.reshape(mb.tokens.shape).detach()}

    per = 2  # micro-batches of 2 rows: a multiple of every pipeline size, as interleaving requires
    batches = [MicroBatch(tokens[i : i + per], positions[i : i + per]) for i in range(0, len(tokens), per)]
    result = engine.forward_backward(batches, loss_fn, forward_only=True)
    if not result:
        return None
    full = torch.cat([m["logp"] for m in result])
    actor = torch.zeros_like(out.log_probs)
    for row, (index, n) in enumerate(zip(out.prompt_index.tolist(), out.lengths.tolist(), strict=True)):
        start = len(PROMPTS[index]) - 1  # logits at position t predict token t+1
        actor[row, :n] = full[row, start : start + n]
    return actor


def _train_batches(ctx: ParallelContext) -> list[MicroBatch]:
    # Four micro-batches: interleaved pipelining (VPP) needs at least two per stage.
    rows = [PROMPTS[1] * 2, PROMPTS[3] * 2, PROMPTS[0] * 3, PROMPTS[2] * 4]
    tokens = _padded_tokens(rows, ctx.tp_size if ctx.layout.sp else 1)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return [MicroBatch(tokens[i : i + 1], positions[i : i + 1]) for i in range(len(tokens))]


def _case(
    ctx: ParallelContext, arch: ModelArch, tp_g: int, seed: int, full_state: Any = None
) -> dict[str, Any]:
    """Two switches to rollout with a training step between them; per switch the max log-prob gap."""
    engine = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-2))
    engine.load_full_state((full_state or _full_state)(arch, seed))
    hybrid, rollout = build_local_hybrid(engine, tp_g, HybridConfig(bucket_bytes=16 << 10))
    diffs, received = [], []
    for step in range(2):
        transition = hybrid.to_rollout()
        assert not rollout.missing_weights()
        params = SamplingParams(temperature=TEMPERATURE, n=2, max_new_tokens=6, seed=seed + step)
        out = rollout.generate(PROMPTS, params)
        hybrid.to_train()
        actor = actor_log_probs(engine, ctx, out, arch.vocab_size)
        if actor is not None:
            diffs.append(float((actor - out.log_probs)[out.response_mask()].abs().max()))
        assert transition.reshard is not None
        received.append(transition.reshard.bytes_received)
        # One real update between the two switches: the second rollout must see the new weights.
        engine.train_step(_train_batches(ctx), lambda o, mb: (o.float().logsumexp(-1).mean(), {}))
    return {
        "diffs": diffs,
        "received": received,
        "planned": hybrid.plan.received_bytes()[dist.get_rank()],
        "phase": hybrid.phase,
        "history": len(hybrid.history),
    }


def run_layout(parallel: dict[str, Any], group: list[tuple[str, int]]) -> dict[str, dict[str, Any]]:
    """Every (arch variant, rollout tp) case of one train layout, in one ParallelContext."""
    archs = arch_variants()
    results = {}
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        for index, (variant, tp_g) in enumerate(group):
            arch = ModelArch.from_hf_config(archs[variant])
            results[f"{variant}/rollout-tp{tp_g}"] = _case(ctx, arch, tp_g, seed=100 + index)
    return results


def check_layout(per_rank: list[dict[str, dict[str, Any]]]) -> None:
    failures = []
    for case in per_rank[0]:
        results = [r[case] for r in per_rank]
        for rank, r in enumerate(results):
            assert r["phase"] is Phase.TRAIN and r["history"] == 4, f"{case} rank {rank}: {r}"
            if any(got != r["planned"] for got in r["received"]):
                failures.append(f"{case} rank {rank}: received {r['received']} bytes, plan {r['planned']}")
        diffs = [d for r in results for d in r["diffs"]]
        assert len(diffs) == 2 * sum(1 for r in results if r["diffs"]), case  # before and after the step
        if not diffs or max(diffs) > ATOL:
            failures.append(
                f"{case}: max |rollout - actor| log-prob gap {max(diffs, default=float('nan')):.3g}"
            )
    assert not failures, "\n".join(failures)


ALL_CASES = cases()
DEFAULT = by_layout(default_cases(ALL_CASES))
SWEEP = by_layout([c for c in ALL_CASES if c not in default_cases(ALL_CASES)])


def test_matrix_is_generated_and_covers_every_axis():
    """Default plus sweep is the whole accepted product; the default run keeps every layout kind, every
    rollout TP, tied embeddings under PP and tp_g > tp > 1 under PP."""
    # what the two parametrizations run, case by case: each accepted case exactly once, in one of them
    default = [(lay, v, tp_g) for lay, group in DEFAULT for v, tp_g in group]
    sweep = [(lay, v, tp_g) for lay, group in SWEEP for v, tp_g in group]
    assert len(set(default)) == len(default) and not set(default) & set(sweep)
    assert sorted(default + sweep) == sorted(ALL_CASES) and len(set(ALL_CASES)) == len(ALL_CASES)
    names = [name for name, _ in DEFAULT]
    for kind in ("tp4", "pp4", "dp4", "-sp", "-vpp2", "tp2-pp2"):
        assert any(kind in n for n in names), kind
    assert {tp_g for _, group in DEFAULT for _, tp_g in group} == set(ROLLOUT_TP)
    parallel = train_layouts()
    with_pp = [(n, g) for n, g in DEFAULT if parallel[n]["pipeline_model_parallel_size"] > 1]
    assert any(tp_g > parallel[n]["tensor_model_parallel_size"] > 1 for n, g in with_pp for _, tp_g in g)
    assert arch_variants()["all"]["tie_word_embeddings"] and with_pp
    assert {v for _, v, _ in ALL_CASES} == set(arch_variants())


@pytest.mark.parametrize(("layout", "group"), DEFAULT, ids=[name for name, _ in DEFAULT])
def test_rollout_log_probs_equal_actor_log_probs(run_distributed, layout, group):
    check_layout(run_distributed(run_layout, train_layouts()[layout], group, world_size=WORLD))


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize(("layout", "group"), SWEEP, ids=[name for name, _ in SWEEP])
def test_every_feature_on_every_layout(run_distributed, layout, group):
    check_layout(run_distributed(run_layout, train_layouts()[layout], group, world_size=WORLD))
