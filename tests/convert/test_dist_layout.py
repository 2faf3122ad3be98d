"""The converter's checkpoint plan is what megatron itself writes: same keys, shapes, chunks, objects.

A random model saved by megatron at TP2 x PP2 (4 ranks) and the same architecture converted from HF with
``--tp 2 --pp 2`` on the same 4 ranks must have identical DCP metadata (tensor keys, global shapes, dtypes,
chunk boxes) and identical ``_extra_state`` objects. The vocab rows a checkpoint can hold are megatron's
padding at a TP the model admits.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from mcore_rl.convert.dist_layout import stored_vocab_rows
from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import save_model
from mcore_rl.engine.model import build_model_chunks
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.convert.hf_models import save_hf_model
from tests.models import tiny_arch

LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def _megatron_and_converted(hf_dirs: list[str], tmp: str) -> None:
    for i, hf_dir in enumerate(hf_dirs):
        arch = ModelArch.from_hf_config(hf_dir)
        with ParallelContext.initialize(ParallelConfig(**LAYOUT)) as ctx:
            save_model(build_model_chunks(arch, ctx), ctx, os.path.join(tmp, f"megatron{i}"))
        convert_hf_to_mcore(HfToMcoreOptions(hf_dir, os.path.join(tmp, f"converted{i}"), tp=2, pp=2))


def _describe(directory: str) -> dict:
    metadata = FileSystemReader(directory).read_metadata()
    described = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            described[key] = (tuple(md.size), md.properties.dtype, boxes)
        else:
            assert isinstance(md, BytesStorageMetadata)
            described[key] = _stored_object(directory, metadata, key)
    return described


def _stored_object(directory: str, metadata, key: str) -> object:
    import io

    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def test_converted_checkpoint_has_megatrons_layout(run_distributed, tmp_path):
    hf_dirs = [
        save_hf_model(str(tmp_path / "llama"), "llama"),
        save_hf_model(str(tmp_path / "qwen2"), "qwen2"),  # tied: the last stage's output is a replica
    ]
    run_distributed(_megatron_and_converted, hf_dirs, str(tmp_path), world_size=4)
    for i in range(len(hf_dirs)):
        megatron, converted = (
            _describe(str(tmp_path / f"megatron{i}")),
            _describe(str(tmp_path / f"converted{i}")),
        )
        assert sorted(megatron) == sorted(converted)
        for key in megatron:
            assert megatron[key] == converted[key], key
        assert sorted(os.listdir(tmp_path / f"megatron{i}")) == [
            ".mcore_rl-output.json",  # our marker: save_model's folder is ours to replace later
            ".metadata",
            *[f"__{r}_0.distcp" for r in range(4)],
            "common.pt",
            "metadata.json",
        ]
        assert torch.load(tmp_path / f"converted{i}" / "common.pt") == torch.load(
            tmp_path / f"megatron{i}" / "common.pt"
        )


def test_stored_vocab_rows_are_the_vocab_padded_at_a_tp_the_model_admits():
    # Llama 3 8B: 128256 = 1002 x 128 (TP1, 2); 129024 = 126 x 1024 (TP4: 128512; TP8). 8 kv heads: TP <= 8.
    heads = {"num_attention_heads": 32, "num_key_value_heads": 8}
    assert stored_vocab_rows(tiny_arch("llama", vocab_size=128256, **heads)) == [128256, 128512, 129024]
    # A config with a smaller vocab no longer fits the checkpoint's rows (the old rule took any rows >= vocab).
    assert stored_vocab_rows(tiny_arch("llama", vocab_size=128000, **heads)) == [128000]
    assert stored_vocab_rows(tiny_arch("llama")) == [250, 256]  # 2 kv heads: TP1 and TP2 both pad to 256
