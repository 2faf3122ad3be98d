"""What keeps mcore_rl on megatron-core releases after the 0.16.1 this machine runs (0.17+ needs Python 3.12):
each test pins the behaviour a newer megatron changes under us (see each docstring), so it holds here and
there."""

from __future__ import annotations

import types

import pytest
import torch


def test_megatron_saves_through_our_in_process_strategy(tmp_path, monkeypatch) -> None:
    """From 0.17 ``dist_checkpointing.save`` swaps any strategy that is not a ``TorchDistSaveShardedStrategy``
    for its default writer (a spawned Manager per save) without a word: ours must be one, and be called."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from mcore_rl.engine import checkpoint

    strategy = checkpoint.save_strategy()
    assert isinstance(strategy, TorchDistSaveShardedStrategy)
    calls = []
    save = type(strategy).save
    monkeypatch.setattr(type(strategy), "save", lambda self, *a: calls.append(a) or save(self, *a))
    monkeypatch.setattr(checkpoint, "save_strategy", lambda: strategy)
    from mcore_rl.engine.model import build_model_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from tests.models import tiny_arch

    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        checkpoint.save_model(build_model_chunks(arch, ctx), ctx, str(tmp_path / "model"))
    assert len(calls) == 1 and (tmp_path / "model" / "metadata.json").is_file()


def test_a_checkpoint_keeps_its_common_state_in_common_pt_or_among_its_data(tmp_path, monkeypatch) -> None:
    """megatron-core 0.19+ writes no ``common.pt``: the common state is a ``common_state`` sharded object."""
    from mcore_rl.engine import checkpoint
    from mcore_rl.io.errors import InputError

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    keys = {"embedding.word_embeddings.weight": None}
    monkeypatch.setattr(
        checkpoint, "read_dcp_metadata", lambda d: types.SimpleNamespace(state_dict_metadata=keys)
    )
    with pytest.raises(InputError, match=r"common\.pt is missing"):
        checkpoint.check_checkpoint_folder(str(folder))
    keys["common_state"] = None
    checkpoint.check_checkpoint_folder(str(folder))


def test_the_cpu_patches_answer_what_newer_megatron_asks() -> None:
    """0.19 calls ``torch.cuda.current_stream()`` on every gradient sync; megatron main passes
    ``activation_func_clamp_value`` to the SwiGLU entry and ``max_seqlen=`` to ``apply_rotary_pos_emb``."""
    from mcore_rl.compat import cpu_layers, megatron_cpu

    if torch.cuda.is_available():
        pytest.skip("the CPU patches are not applied where CUDA is")
    assert megatron_cpu.apply()
    stream = torch.cuda.current_stream()
    stream.wait_event(None)
    stream.wait_stream(None)
    seen = []
    swiglu = cpu_layers.bias_swiglu_impl(lambda *a, **k: seen.append((a, k)) or a[0])
    x = torch.randn(3, 8)
    assert torch.equal(
        swiglu(x, None, False, False, None), swiglu(x, None)
    )  # the new argument at its default
    assert not seen
    swiglu(x, None, False, False, 7.0)  # a clamp: megatron's own path, every argument passed on
    assert seen == [((x, None, False, False, 7.0), {})]
    original = []
    rope = cpu_layers.apply_rotary_pos_emb(lambda *a, **k: original.append(k) or a[0])
    config = types.SimpleNamespace(
        apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False
    )
    t, freqs = torch.randn(5, 1, 2, 4), torch.randn(5, 1, 1, 4)
    assert torch.equal(rope(t, freqs, config, max_seqlen=5), rope(t, freqs, config))
    assert not original
    rope(t, freqs, config, mscale=2.0, max_seqlen=5)
    assert original[0]["max_seqlen"] == 5
