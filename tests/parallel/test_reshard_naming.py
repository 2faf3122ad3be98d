"""The one parameter naming (canonical keys, holder stages) and the executor's refusal of keys it does not
plan: pure, no processes. The end-to-end proof on real megatron chunks is the hybrid parity matrix, whose
executor raises on any key mismatch."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.parallel.reshard import build_plan, execution_schedule, model_param_specs, padded_rows
from mcore_rl.parallel.reshard.executor import _sources
from mcore_rl.parallel.reshard.naming import EMBEDDING_KEY, OUTPUT_KEY, canonical_key, holder_stages
from mcore_rl.parallel.sharding import tp_shard
from tests.parallel.test_reshard_plan import ARCH


@pytest.mark.parametrize(
    ("local", "offset", "tied", "key"),
    [
        (OUTPUT_KEY, 0, True, EMBEDDING_KEY),  # the last stage's tied copy is the embedding
        (OUTPUT_KEY, 0, False, OUTPUT_KEY),
        (EMBEDDING_KEY, 0, True, EMBEDDING_KEY),
        ("decoder.layers.1.mlp.linear_fc1.weight", 6, True, "decoder.layers.7.mlp.linear_fc1.weight"),
        (
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",  # Transformer-Engine's fused norm
            2,
            False,
            "decoder.layers.2.input_layernorm.weight",
        ),
        ("decoder.final_layernorm.weight", 3, True, "decoder.final_layernorm.weight"),
    ],
)
def test_canonical_key(local, offset, tied, key):
    assert canonical_key(local, offset, tied=tied) == key


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_every_key_a_stage_holds_is_planned_with_that_stage_as_a_source(pp, tied):
    """What megatron allocates per stage, named by canonical_key, equals what holder_stages plans."""
    train = ParallelLayout(4, pp=pp)
    specs = {s.name: s for s in model_param_specs(**ARCH, tie_word_embeddings=tied)}
    per_stage = ARCH["num_layers"] // pp
    for stage in range(pp):
        local = [f"decoder.layers.{i}.input_layernorm.weight" for i in range(per_stage)]
        if stage == 0:
            local.append(EMBEDDING_KEY)
        if stage == pp - 1:
            local.append("decoder.final_layernorm.weight")
            if not tied or pp > 1:  # tied on one stage: the output layer reads the embedding, no own weight
                local.append(OUTPUT_KEY)
        for name in local:
            key = canonical_key(name, stage * per_stage, tied=tied)
            assert key in specs, key
            assert stage in holder_stages(key, specs[key].layer, train, ARCH["num_layers"], tied), (
                key,
                stage,
            )


def test_executor_names_a_key_the_plan_does_not_know_and_the_rank():
    """The bug this naming fixes: the last stage reporting its tied copy as the output layer."""
    train = ParallelLayout(4, tp=2, pp=2)
    specs = model_param_specs(**ARCH, tie_word_embeddings=True)
    plan = build_plan(specs, train, 1, num_layers=ARCH["num_layers"], tied_embeddings=True)
    rank = 3  # last stage
    local = {
        s.name: tp_shard(torch.zeros(s.shape), s.kind, train.coords(rank).tp, 2, padded_rows(s, 2))
        for s in specs
        if train.coords(rank).pp in holder_stages(s.name, s.layer, train, ARCH["num_layers"], True)
    }
    schedule = execution_schedule(plan, rank)
    assert _sources(plan, rank, local, schedule).keys() == local.keys()
    local[OUTPUT_KEY] = local.pop(EMBEDDING_KEY)
    with pytest.raises(KeyError, match=r"rank 3: local parameters \['output_layer.weight'\] are not in the"):
        _sources(plan, rank, local, schedule)
    del local[OUTPUT_KEY]
    with pytest.raises(KeyError, match=r"rank 3: the plan reads \['embedding.word_embeddings.weight'\]"):
        _sources(plan, rank, local, schedule)
