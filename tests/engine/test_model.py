"""Model builders: value head, weight round trips, bf16 training, spec choice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.model import ModelOptions, ValueHead, build_model_chunks
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import gather_full_state, load_full_state, unwrap
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import LabeledMicroBatch, tiny_arch

SEQ = 8


def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def _values_in_layout(parallel: dict) -> dict:
    arch = tiny_arch("qwen2")  # tied embeddings: the value head must not tie to them
    options = ModelOptions(value_head=True)
    tokens, positions = _tokens(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx, options), arch, ctx)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, options, OptimConfig(weight_decay=0.0, lr=1e-3))
        engine.load_full_state(full)
        out = engine.forward_backward(
            [MicroBatch(tokens, positions)],
            lambda o, mb: (o.sum() * 0, {"values": o.detach()}),
            forward_only=True,
        )
        head = unwrap(engine.models[-1]).output_layer if ctx.is_last_stage else None
        return {
            "values": out[0]["values"] if out else None,
            "head_is_value_head": isinstance(head, ValueHead) if head is not None else None,
            "full_has_head": full["output_layer.weight"].shape,
        }


@pytest.mark.parametrize(
    ("parallel", "ranks_with_values"),
    [
        ({}, [True, True]),  # DP2: each replica ends in the head
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, [True, True]),  # both TP ranks
        ({"pipeline_model_parallel_size": 2}, [False, True]),  # the last stage alone holds the head
    ],
    ids=["tp1", "tp2-sp", "pp2"],
)
def test_value_head_is_scalar_and_layout_invariant(run_distributed, parallel, ranks_with_values):
    reference = run_distributed(_values_in_layout, {})[0]["values"]
    assert reference.shape == (2, SEQ, 1)
    results = run_distributed(_values_in_layout, parallel)
    assert [r["values"] is not None for r in results] == ranks_with_values
    for result in results:
        assert result["full_has_head"] == (1, 64)
        if result["values"] is not None:
            assert result["head_is_value_head"]
            assert (result["values"] - reference).abs().max() <= 1e-5


def _round_trip(parallel: dict) -> bool:
    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)
    perturbed = {k: v + 0.25 * torch.randn_like(v) for k, v in full.items()}
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        chunks = build_model_chunks(arch, ctx)
        load_full_state(chunks, perturbed, arch, ctx)
        back = gather_full_state(chunks, arch, ctx)
    assert back.keys() == perturbed.keys()
    assert back["embedding.word_embeddings.weight"].shape[0] == arch.vocab_size  # no padding rows
    return all(torch.equal(back[k], perturbed[k]) for k in perturbed)


@pytest.mark.parametrize(
    ("parallel", "world_size"),
    [
        ({"tensor_model_parallel_size": 2}, 2),
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 2),
        ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 4),
    ],
    ids=["tp2", "pp2-vpp2", "tp2-pp2"],
)
def test_full_state_round_trips_through_any_layout(run_distributed, parallel, world_size):
    assert all(run_distributed(_round_trip, parallel, world_size=world_size))


def test_a_vocab_tensor_shorter_than_the_vocab_is_refused():
    """Padding rows are added to the embedding and head on load; a state with fewer rows than the vocab had
    its missing real tokens' rows filled with zeros in silence."""
    from mcore_rl.engine.rollout.layout import rollout_shards_from_full

    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        chunks = build_model_chunks(arch, ctx)
        full = gather_full_state(chunks, arch, ctx)
        short = {**full, "embedding.word_embeddings.weight": full["embedding.word_embeddings.weight"][:-10]}
        with pytest.raises(
            ValueError, match=r"word_embeddings\.weight: \d+ rows, fewer than the model's vocab_size"
        ):
            load_full_state(chunks, short, arch, ctx)
        with pytest.raises(ValueError, match=r"fewer than vocab_size"):
            rollout_shards_from_full(short, arch, 1, 0)


def _bf16_training() -> dict:
    arch = tiny_arch("llama")
    tokens, positions = _tokens(arch.vocab_size)
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        engine = TrainEngine.build(
            arch, ctx, ModelOptions(dtype=torch.bfloat16), OptimConfig(weight_decay=0.0, lr=3e-3)
        )
        batch = LabeledMicroBatch(tokens, positions, labels=torch.roll(tokens, -1, 1))

        def loss_fn(output, mb):
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(
                output.float().transpose(0, 1).contiguous(), mb.labels.t().contiguous()
            ).mean()
            return loss, {"loss": loss.detach().clone()}

        losses = [float(engine.train_step([batch], loss_fn)[1][0]["loss"]) for _ in range(6)]
        dtypes = {p.dtype for m in engine.models for p in m.parameters()}
        # what Adam steps: fp32 copies apart from the bf16 weights (stepping those would round small updates away)
        stepped = [p for o in engine.optimizers for g in o.optimizer.param_groups for p in g["params"]]
        weights = {p.untyped_storage().data_ptr() for m in engine.models for p in m.parameters()}
        main = {
            "dtypes": {p.dtype for p in stepped},
            "apart": not any(p.untyped_storage().data_ptr() in weights for p in stepped),
            "count": len(stepped),
        }
        return {"losses": losses, "dtypes": dtypes, "main": main, "rank": dist.get_rank()}


def test_bf16_trains_with_fp32_main_params(run_distributed):
    rank0, rank1 = run_distributed(_bf16_training)
    assert rank0["dtypes"] == {torch.bfloat16}
    assert (
        rank0["main"]["count"] > 0 and rank0["main"]["dtypes"] == {torch.float32} and rank0["main"]["apart"]
    )
    assert rank0["losses"] == rank1["losses"]  # TP ranks agree on the loss
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.5  # and the bf16 model really learns


def test_local_spec_is_used_without_transformer_engine():
    from mcore_rl.engine.model import _layer_spec, transformer_engine_available

    assert not transformer_engine_available()
    spec = _layer_spec(ModelOptions(), tiny_arch("qwen3"))
    assert "Norm" in repr(spec.submodules.self_attention.submodules.q_layernorm)  # Qwen3's q/k norms
    assert "TE" not in repr(spec.submodules.self_attention.submodules.linear_qkv)


def test_the_config_builds_without_megatrons_deprecation_warning(run_distributed):
    """megatron 0.16's default cuda_graph_scope warned 'full scope is deprecated' on every rank's console."""
    run_distributed(_config_warnings, world_size=1)


def _config_warnings() -> None:
    import warnings

    from mcore_rl.engine.model import transformer_config

    with ParallelContext.initialize(ParallelConfig()) as ctx, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config(tiny_arch("llama"), ctx, ModelOptions())
    assert not [w for w in caught if "scope is deprecated" in str(w.message)], [
        str(w.message) for w in caught
    ]
    assert list(config.cuda_graph_scope) == []  # the whole layer, as "full" meant


def test_model_options_validate_dtype():
    with pytest.raises(ValueError, match=r"dtype must be torch\.float32 or torch\.bfloat16"):
        ModelOptions(dtype=torch.float16)


def _init_weights(parallel: dict) -> dict[str, dict[str, torch.Tensor]]:
    arch = tiny_arch("llama")
    out = {}
    for scaled in (True, False):
        with ParallelContext.initialize(ParallelConfig(**parallel), seed=7) as ctx:
            chunks = build_model_chunks(arch, ctx, ModelOptions(scaled_output_init=scaled))
            out["scaled" if scaled else "plain"] = gather_full_state(chunks, arch, ctx)
    return out


@pytest.mark.parametrize("parallel", [{}, {"tensor_model_parallel_size": 2}], ids=["tp1", "tp2"])
def test_plain_init_draws_output_projections_at_the_full_std(run_distributed, parallel):
    """``scaled_output_init=False`` (transformers' Llama init) changes only the scale of the attention and
    MLP output projections: the same draws, sqrt(2 x layers) larger; every other tensor is identical."""
    for result in run_distributed(_init_weights, parallel):
        scaled, plain = result["scaled"], result["plain"]
        arch = tiny_arch("llama")
        factor = (2 * arch.num_layers) ** 0.5
        outputs = [k for k in scaled if k.endswith(("linear_proj.weight", "linear_fc2.weight"))]
        assert len(outputs) == 2 * arch.num_layers
        for key in scaled:
            if key in outputs:
                torch.testing.assert_close(plain[key], scaled[key] * factor, rtol=1e-5, atol=0)
                assert abs(float(plain[key].std()) / arch.initializer_range - 1) < 0.1
            else:
                assert torch.equal(plain[key], scaled[key]), key
