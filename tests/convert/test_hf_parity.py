"""Converted checkpoints against transformers: bit-exact round trips and logits at every layout.

HF -> mcore runs on every rank of the pool's world (each rank writes the chunks its (tp, pp) position
owns); the trainer then loads the checkpoint at TP1, TP2, PP2 (world 2) and TP2 x PP2 (world 4), and its
logits must match transformers' in fp32. A checkpoint trained for a few steps exports back to HF and
transformers reproduces the trainer's logits.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore
from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf
from mcore_rl.engine.checkpoint import ModelCheckpointInfo, load_model, save_model
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.convert.hf_models import VARIANTS, hf_logits, listing, save_hf_model
from tests.models import LabeledMicroBatch

ATOL = 1e-4
SEQ = 16  # > mistral's sliding window of 8
WORLD2_LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}
WORLD4_LAYOUTS = {"tp2-pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}


def _tokens(vocab: int = 250, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(11))


def _masked(output: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-padding columns of this TP rank's logits set to -inf (they are not real tokens)."""
    from megatron.core import parallel_state

    shard = output.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * shard
    return output.float().masked_fill(torch.arange(first, first + shard) >= vocab_size, float("-inf"))


def _collect_logits(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(output.float())[..., : mb.vocab_size]
    return output.sum() * 0.0, {"logits": full.detach()}


def _ce_loss(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = _masked(output, mb.vocab_size)
    per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), mb.labels.t().contiguous())
    loss = per_token.mean()
    return loss, {"loss": loss.detach().clone()}


def _micro_batch(tokens: torch.Tensor, vocab_size: int) -> MicroBatch:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    return LabeledMicroBatch(tokens, positions, labels=labels, vocab_size=vocab_size)


def _engine(ckpt: str, ctx: ParallelContext, lr: float = 0.0) -> TrainEngine:
    info = ModelCheckpointInfo.read(ckpt)
    assert info is not None
    engine = TrainEngine.build(info.arch, ctx, ModelOptions(), OptimConfig(weight_decay=0.0, lr=lr))
    load_model(engine.models, ctx, ckpt)
    engine.optimizer.reload_model_params()
    return engine


def _forward(engine: TrainEngine, tokens: torch.Tensor) -> torch.Tensor | None:
    """Gathered logits [b, s, vocab] on last-stage ranks, None elsewhere (every DP rank runs the whole batch)."""
    metrics = engine.forward_backward(
        [_micro_batch(tokens, engine.arch.vocab_size)], _collect_logits, forward_only=True
    )
    return metrics[0]["logits"] if metrics else None


def _convert_and_forward(
    hf_dir: str, ckpt: str, layouts: dict, tokens: torch.Tensor, tp: int, pp: int, ep: int = 1
) -> dict:
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, ckpt, tp=tp, pp=pp, ep=ep))
    logits = {}
    for name, parallel in layouts.items():
        with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
            out = _forward(_engine(ckpt, ctx), tokens)
            if out is not None:
                logits[name] = out
    return logits


def _max_diffs(results: list[dict], expected: torch.Tensor) -> dict[str, float]:
    diffs: dict[str, float] = {}
    for per_rank in results:
        for name, logits in per_rank.items():
            diffs[name] = max(diffs.get(name, 0.0), float((logits - expected).abs().max()))
    return diffs


def _check_parity(
    run_distributed, tmp_path, variant: str, layouts: dict, world_size: int, tp: int, pp: int
) -> None:
    family, overrides = VARIANTS[variant]
    hf_dir = save_hf_model(str(tmp_path / "hf"), family, **overrides)
    tokens = _tokens()
    expected = hf_logits(hf_dir, tokens)
    results = run_distributed(
        _convert_and_forward, hf_dir, str(tmp_path / "ckpt"), layouts, tokens, tp, pp, world_size=world_size
    )
    diffs = _max_diffs(results, expected)
    print(f"\n{variant}: max |logit diff| vs transformers {diffs}")
    assert set(diffs) == set(layouts)
    assert all(d <= ATOL for d in diffs.values()), diffs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_tp1_tp2_pp2(run_distributed, tmp_path, variant):
    _check_parity(run_distributed, tmp_path, variant, WORLD2_LAYOUTS, world_size=2, tp=2, pp=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_tp2_pp2(run_distributed, tmp_path, variant):
    # Converted with the same (tp, pp) as the 4 ranks: each rank writes exactly its trainer position's shard.
    _check_parity(run_distributed, tmp_path, variant, WORLD4_LAYOUTS, world_size=4, tp=2, pp=2)


def _round_trip(hf_dir: str, ckpt: str, out: str, tp: int, max_shard_bytes: int) -> list[str]:
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, ckpt, tp=tp))
    convert_mcore_to_hf(McoreToHfOptions(ckpt, out, max_shard_bytes=max_shard_bytes))  # rank 0 only
    return listing(ckpt)


def _all_tensors(directory: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in listing(directory):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


@pytest.mark.parametrize(
    ("variant", "dtype", "shard"),
    [
        ("llama3-rope", torch.bfloat16, "60KB"),
        ("qwen2-tied-bias", torch.float32, None),
        ("mistral-window", torch.float32, None),
        ("qwen3-qk-norm", torch.bfloat16, None),
    ],
)
def test_hf_mcore_hf_is_bit_exact(run_distributed, tmp_path, variant, dtype, shard):
    import json

    family, overrides = VARIANTS[variant]
    hf_dir = save_hf_model(
        str(tmp_path / "hf"), family, dtype=dtype, max_shard_size=shard, with_tokenizer=True, **overrides
    )
    out = tmp_path / "back"
    ckpt_files = run_distributed(_round_trip, hf_dir, str(tmp_path / "ckpt"), str(out), 2, 150_000)[0]
    assert "metadata.json" in ckpt_files and "mcore_rl_model.json" in ckpt_files
    before, after = _all_tensors(hf_dir), _all_tensors(str(out))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text()
    )
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side).read_bytes() == (tmp_path / "hf" / side).read_bytes()
    if shard:  # several input and output shards, each with its index
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
        assert (out / "model.safetensors.index.json").exists()


def _train_save_export(hf_dir: str, tmp: str, tokens: torch.Tensor) -> dict:
    ckpt, trained, exported = (os.path.join(tmp, n) for n in ("ckpt", "trained", "exported"))
    convert_hf_to_mcore(HfToMcoreOptions(hf_dir, ckpt))
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        engine = _engine(ckpt, ctx, lr=1e-2)
        batch = [_micro_batch(tokens, engine.arch.vocab_size)]
        losses = [float(engine.train_step(batch, _ce_loss)[1][0]["loss"]) for _ in range(3)]
        logits = _forward(engine, tokens)
        info = ModelCheckpointInfo.for_arch(engine.arch, torch.float32)
        save_model(engine.models, ctx, trained, info)
    convert_mcore_to_hf(McoreToHfOptions(trained, exported))
    return {"logits": logits, "losses": losses, "exported": exported}


@pytest.mark.parametrize("variant", ["llama3-rope", "qwen2-tied-bias", "qwen3-qk-norm"])
def test_trained_checkpoint_exports_to_hf(run_distributed, tmp_path, variant):
    family, overrides = VARIANTS[variant]
    hf_dir = save_hf_model(str(tmp_path / "hf"), family, **overrides)
    tokens = _tokens()
    results = run_distributed(_train_save_export, hf_dir, str(tmp_path), tokens)
    losses = results[0]["losses"]
    assert losses[-1] < losses[0]  # the weights did move
    exported = hf_logits(results[0]["exported"], tokens)
    diff = max(float((r["logits"] - exported).abs().max()) for r in results)
    print(f"\n{variant}: trained TP2 engine vs transformers on the export, max |logit diff| {diff:.2e}")
    assert diff <= ATOL
    assert float((exported - hf_logits(hf_dir, tokens)).abs().max()) > 1e-2
