"""Pure pieces of the converter: HF <-> full-state transforms, the checkpoint plan, streaming safetensors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.convert.cli import parse_dtype, parse_size
from mcore_rl.convert.dist_layout import checkpoint_location, checkpoint_plan
from mcore_rl.engine.hf.mapping import (
    ConvertError,
    check_convertible,
    full_shape,
    fuse_qkv,
    hf_shapes,
    split_qkv,
    tensor_maps,
    to_full,
    to_hf,
)
from mcore_rl.engine.hf.safetensors_io import (
    INDEX_FILE,
    OutputTensor,
    SafetensorsReader,
    StreamingShardWriter,
)
from mcore_rl.io.errors import UsageError
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.parallel.sharding import ShardKind, shard_kind, tp_shard
from tests.models import tiny_arch


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_transform_round_trips_bit_exactly(family):
    arch = tiny_arch(family)
    generator = torch.Generator().manual_seed(0)
    for tensor_map in tensor_maps(arch):
        hf = [torch.randn(s, generator=generator) for s in hf_shapes(arch, tensor_map)]
        full = to_full(arch, tensor_map, hf)
        assert tuple(full.shape) == full_shape(arch, tensor_map)
        for before, after in zip(hf, to_hf(arch, tensor_map, full), strict=True):
            assert torch.equal(before, after)


def test_qkv_is_grouped_per_query_group_as_megatron_expects():
    arch = tiny_arch("llama")  # 4 heads, 2 groups, head_dim 16
    d = arch.head_dim
    q = torch.arange(4 * d).float()[:, None].expand(-1, 3)
    k = 1000 + torch.arange(2 * d).float()[:, None].expand(-1, 3)
    v = 2000 + torch.arange(2 * d).float()[:, None].expand(-1, 3)
    rows = fuse_qkv(arch, q, k, v)[:, 0]
    group0 = torch.cat([torch.arange(2 * d), 1000 + torch.arange(d), 2000 + torch.arange(d)]).float()
    assert torch.equal(rows[: 4 * d], group0)
    # TP=2 splits whole groups: rank 1 holds exactly group 1's q heads, k and v.
    rank1 = tp_shard(rows, ShardKind.COLUMN, 1, 2)
    assert torch.equal(rank1, torch.cat([q[2 * d :, 0], k[d:, 0], v[d:, 0]]))
    assert all(torch.equal(a, b[:, 0]) for a, b in zip(split_qkv(arch, rows), (q, k, v), strict=True))


def test_names_cover_families():
    assert len(tensor_maps(tiny_arch("llama"))) == 1 + 4 * 6 + 2
    assert len(tensor_maps(tiny_arch("qwen2"))) == 1 + 4 * 7 + 1  # qkv bias; tied: no output layer
    qwen3 = tensor_maps(tiny_arch("qwen3"))
    assert len(qwen3) == 1 + 4 * 8 + 2  # q_norm and k_norm per layer; untied
    norms = [m for m in qwen3 if "q_norm" in m.hf_names[0] or "k_norm" in m.hf_names[0]]
    assert [m.full_name for m in norms[:2]] == [
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight",
    ]
    assert hf_shapes(tiny_arch("qwen3"), norms[0]) == [(24,)]  # head_dim, not hidden
    for family in ("llama", "qwen3"):
        with pytest.raises(ConvertError, match="attention_bias=true is not supported"):
            check_convertible(tiny_arch(family, attention_bias=True))


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_plan_tiles_every_global_tensor_once(tp, pp):
    arch = tiny_arch("qwen2")
    chunks, extra = checkpoint_plan(arch, tp, pp)
    volume: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for c in chunks:
        volume[c.key] = volume.get(c.key, 0) + math.prod(c.sizes)
        assert shapes.setdefault(c.key, c.global_shape) == c.global_shape
        assert all(o + s <= g for o, s, g in zip(c.offsets, c.sizes, c.global_shape, strict=True))
    assert all(volume[k] == math.prod(shapes[k]) for k in shapes)
    assert shapes["embedding.word_embeddings.weight"][0] == padded_vocab_size(250, tp)
    assert {c.writer for c in chunks} == set(range(tp * pp))  # every (tp, pp) position writes
    assert len(extra) == 4 * arch.num_layers
    where = checkpoint_location(arch, "decoder.layers.3.input_layernorm.weight")
    assert (where.key, where.layer, where.prefix_offsets) == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        3,
        (3,),
    )
    assert shard_kind("decoder.layers.0.mlp.linear_fc1.weight") is ShardKind.GATED_COLUMN


def test_streaming_writer_matches_safetensors_and_shards(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "d": torch.randn(4, 4),
    }
    plan = [OutputTensor(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = StreamingShardWriter(str(tmp_path), plan, max_shard_bytes=64)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.finish()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == len(writer.files) > 1
    loaded: dict[str, torch.Tensor] = {}
    for file in writer.files:
        loaded.update(load_file(str(tmp_path / file)))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    reader = SafetensorsReader(str(tmp_path))
    assert reader.infos["b"].dtype == torch.bfloat16 and torch.equal(reader.get("d"), tensors["d"])


def test_writer_refuses_out_of_order_tensors(tmp_path):
    writer = StreamingShardWriter(str(tmp_path), [OutputTensor("a", (2,), torch.float32)], 1 << 20)
    with pytest.raises(ValueError, match="expected a"):
        writer.add("b", torch.zeros(2))


def test_cli_value_parsing():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("100") == 100
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(None) is None
    assert parse_dtype("FP16") is torch.float16
    with pytest.raises(UsageError, match="--dtype 'fp8'"):
        parse_dtype("fp8")
    for bad in ("lots", "0", "0.1B"):
        with pytest.raises(UsageError, match="--max-shard-size"):
            parse_size(bad)


def test_a_run_reading_an_hf_folder_names_attention_bias(tmp_path):
    """The run's own load (actor, critic, DPO) refuses Llama's and Qwen3-MoE's o_proj bias naming the config
    field, as conversion does (it named a stray o_proj.bias tensor, and passed Qwen3-MoE to that check)."""
    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.hf.mapping import ConvertError, check_convertible
    from mcore_rl.engine.hf.state import load_hf_full_state
    from tests.convert.hf_models import save_hf_model
    from tests.models import tiny_hf_config

    folder = save_hf_model(str(tmp_path / "llama"), "llama", attention_bias=True)
    with pytest.raises(ConvertError, match="attention_bias=true is not supported for Llama"):
        load_hf_full_state(folder, ModelArch.from_hf_config(folder))
    with pytest.raises(ConvertError, match="attention_bias=true is not supported for Qwen3_moe"):
        check_convertible(ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", attention_bias=True)))


def test_a_tied_config_refuses_a_stored_head_that_is_not_the_embedding(tmp_path):
    """transformers loads such a head apart (a fine-tune saved untied but labelled tied); a tied model would
    drop it. A copy of the embedding, as some tied checkpoints store, still loads."""
    from safetensors.torch import save_file

    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.hf.mapping import ConvertError
    from mcore_rl.engine.hf.state import load_hf_full_state
    from tests.convert.hf_models import save_hf_model

    folder = save_hf_model(str(tmp_path / "qwen2"), "qwen2")  # tie_word_embeddings: true
    arch = ModelArch.from_hf_config(folder)
    assert arch.tie_word_embeddings
    path = str(tmp_path / "qwen2" / "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    load_hf_full_state(folder, arch)
    tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ConvertError, match=r"lm_head.weight differs from model.embed_tokens.weight.*tie_word"
    ):
        load_hf_full_state(folder, arch)
