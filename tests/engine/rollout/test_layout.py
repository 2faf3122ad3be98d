"""The rollout layout: shapes per TP rank, and the naive megatron-full -> rollout-shard conversion."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.rollout import RolloutLayoutError, rollout_param_shapes, rollout_shards_from_full
from mcore_rl.parallel.layout import padded_vocab_size
from tests.engine.rollout.common import random_full_state
from tests.models import tiny_arch


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shards_have_the_declared_shapes(family, tp):
    arch = tiny_arch(family)
    full = random_full_state(arch)
    shapes = rollout_param_shapes(arch, tp)
    for rank in range(tp):
        shards = rollout_shards_from_full(full, arch, tp, rank)
        assert {n: tuple(t.shape) for n, t in shards.items()} == shapes
    assert ("lm_head.weight" in shapes) != arch.tie_word_embeddings
    assert ("layers.0.self_attn.qkv_proj.bias" in shapes) == arch.qkv_bias


def test_qkv_is_regrouped_from_megatron_groups_to_q_k_v_per_rank():
    """megatron rows are [q heads of group g; k_g; v_g] per query group; a rollout rank holds [q; k; v] of its
    groups. Tag each megatron row with its (kind, head) and check where it lands."""
    arch = tiny_arch("qwen2")  # 4 heads, 2 kv groups, head_dim 16
    hd, per_group = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
    full = random_full_state(arch)
    tags = []
    for group in range(arch.num_query_groups):
        tags += [("q", group * per_group + h) for h in range(per_group) for _ in range(hd)]
        tags += [("k", group)] * hd + [("v", group)] * hd
    full["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.arange(len(tags), dtype=torch.float32)
    for tp in (1, 2):
        for rank in range(tp):
            bias = rollout_shards_from_full(full, arch, tp, rank)["layers.0.self_attn.qkv_proj.bias"]
            landed = [tags[int(i)] for i in bias[::hd]]
            heads = range(rank * arch.num_attention_heads // tp, (rank + 1) * arch.num_attention_heads // tp)
            groups = range(rank * arch.num_query_groups // tp, (rank + 1) * arch.num_query_groups // tp)
            assert landed == [("q", h) for h in heads] + [("k", g) for g in groups] + [
                ("v", g) for g in groups
            ]
            assert torch.equal(
                bias.view(-1, hd) - bias[::hd, None], torch.arange(hd).float().expand(len(landed), hd)
            )


def test_gate_up_down_o_proj_and_vocab_split():
    arch = tiny_arch("llama")
    full = random_full_state(arch)
    fc1 = full["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    vocab_rows = padded_vocab_size(arch.vocab_size, 2, 128) // 2
    shards = [rollout_shards_from_full(full, arch, 2, rank) for rank in range(2)]
    for rank, shard in enumerate(shards):
        assert torch.equal(
            shard["layers.1.mlp.gate_up_proj.weight"], torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        )
    assert torch.equal(
        torch.cat([s["layers.1.mlp.down_proj.weight"] for s in shards], 1),
        full["decoder.layers.1.mlp.linear_fc2.weight"],
    )
    assert torch.equal(
        torch.cat([s["layers.1.self_attn.o_proj.weight"] for s in shards], 1),
        full["decoder.layers.1.self_attention.linear_proj.weight"],
    )
    for name, source in (
        ("embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ):
        merged = torch.cat([s[name] for s in shards])
        assert merged.shape[0] == 2 * vocab_rows
        assert torch.equal(merged[: arch.vocab_size], full[source])
        assert not merged[arch.vocab_size :].any()  # padding rows are zero


def test_tp_that_does_not_divide_the_model_names_the_field():
    arch = tiny_arch("llama")  # 4 heads, 2 kv heads
    with pytest.raises(RolloutLayoutError, match="num_key_value_heads=2"):
        rollout_param_shapes(arch, 4)
    with pytest.raises(RolloutLayoutError, match="num_attention_heads=4"):
        rollout_param_shapes(arch, 3)
