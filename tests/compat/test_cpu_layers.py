"""The CPU model's faster blocks (compat/cpu_layers.py: RMSNorm, SwiGLU and rotary with one-pass backwards;
torch's fused Adam) against megatron's stock local-spec blocks and torch's unfused Adam: same weights, same
batch, logits and gradients within 1e-5 (fp32), for GQA and for a sliding window; bitwise-equal logits where
attention stays megatron's (the sliding window)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from mcore_rl.engine.optim import OptimConfig, use_fused_torch_adam
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.weights import unwrap
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import LabeledMicroBatch, tiny_arch

ROWS, SEQ = 3, 12


@contextlib.contextmanager
def _stock_blocks() -> Iterator[None]:
    """Builds inside use megatron's local spec, torch.nn.RMSNorm and megatron's unfused rotary."""
    from megatron.core.transformer import attention

    from mcore_rl.compat import cpu_layers

    saved = (attention.apply_rotary_pos_emb, cpu_layers.local_spec, cpu_layers.FusedRMSNorm)
    attention.apply_rotary_pos_emb = saved[0]._mcore_rl_original
    cpu_layers.local_spec = lambda spec: spec
    cpu_layers.FusedRMSNorm = torch.nn.RMSNorm  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        attention.apply_rotary_pos_emb, cpu_layers.local_spec, cpu_layers.FusedRMSNorm = saved  # type: ignore[misc]


def _loss(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A per-token mean of weighted log-probs (a policy-gradient-like loss with gradients of order 1)."""
    weights = mb.weights
    loss = (torch.log_softmax(logits.float(), -1) * weights).sum() / (ROWS * SEQ)
    return loss, {"logits": logits.detach()}


def _grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.clone() for name, p in engine.chunks[0].named_parameters()}


def _copy_weights(source: TrainEngine, target: TrainEngine) -> None:
    """Every weight, the padded vocab rows included (``load_full_state`` leaves those out)."""
    state = {k: v for k, v in source.models[0].state_dict().items() if not k.endswith("_extra_state")}
    unexpected = target.models[0].load_state_dict(state, strict=False).unexpected_keys
    assert not unexpected
    target.optimizer.reload_model_params()


def _fused_vs_stock(family: str) -> dict[str, float]:
    arch = tiny_arch(family)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (ROWS, SEQ), generator=gen)
    weights = torch.randn(ROWS, SEQ, 256, generator=gen)  # padded vocab 256
    batch = LabeledMicroBatch(tokens, torch.arange(SEQ).expand(ROWS, SEQ), weights=weights)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        fused = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-3))
        with _stock_blocks():
            stock = TrainEngine.build(arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-3))
        stock.config.bias_activation_fusion = False  # megatron's chunk -> silu -> mul
        _copy_weights(fused, stock)
        layer, stock_layer = fused.models[0].decoder.layers[0], stock.models[0].decoder.layers[0]
        kinds = {
            type(layer.self_attention.core_attention).__name__,
            type(layer.input_layernorm).__name__,
            type(stock_layer.self_attention.core_attention).__name__,
            type(stock_layer.input_layernorm).__name__,
        }
        assert kinds == {"SdpaDotProductAttention", "FusedRMSNorm", "DotProductAttention", "RMSNorm"}
        out = {}
        for engine in (fused, stock):
            engine.zero_grad()
            out[engine] = engine.forward_backward([batch], _loss)[0]["logits"], _grads(engine)
        (logits, grads), (stock_logits, stock_grads) = out[fused], out[stock]
        return {
            "logits": (logits - stock_logits).abs().max().item(),
            "grads": max((grads[k] - stock_grads[k]).abs().max().item() for k in grads),
            "grad_scale": max(g.abs().max().item() for g in grads.values()),
        }


@pytest.mark.parametrize("family", ["llama", "mistral"], ids=["gqa", "sliding-window"])
def test_fused_blocks_match_megatron_stock_blocks(run_distributed, family) -> None:
    (diff,) = run_distributed(_fused_vs_stock, family, world_size=1)
    if family == "mistral":  # windowed attention stays megatron's: then every forward is bitwise megatron's
        assert diff["logits"] == 0.0
    assert 0.0 < diff["logits"] <= 1e-5 or family == "mistral"  # causal attention is torch's fused kernel
    assert diff["grads"] <= 1e-5
    assert diff["grad_scale"] > 1e-3  # the comparison is not between two zero gradients


def _attention_with_masks() -> dict[str, bool | float]:
    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        fused = TrainEngine.build(arch, ctx)
        with _stock_blocks():
            stock = TrainEngine.build(arch, ctx)
        ours = unwrap(fused.chunks[0]).decoder.layers[0].self_attention.core_attention
        megatron = unwrap(stock.chunks[0]).decoder.layers[0].self_attention.core_attention
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(SEQ, 2, 4, 16, generator=gen)
        k, v = torch.randn(SEQ, 2, 2, 16, generator=gen), torch.randn(SEQ, 2, 2, 16, generator=gen)
        causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        padded = causal | (torch.arange(SEQ) >= SEQ - 3).view(1, 1, 1, SEQ)  # last 3 keys are padding
        fused = torch.nn.functional.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True
        )
        return {
            "default_mask_close": (ours(q, k, v, None) - megatron(q, k, v, None)).abs().max().item(),
            "default_is_fused_kernel": torch.equal(ours(q, k, v, None), fused.permute(2, 0, 1, 3).flatten(2)),
            "explicit_mask_equal": torch.equal(ours(q, k, v, padded), megatron(q, k, v, padded)),
            "mask_matters": (megatron(q, k, v, padded) - megatron(q, k, v, None)).abs().max().item(),
        }


def test_causal_rows_run_the_fused_kernel_and_masks_keep_megatrons(run_distributed) -> None:
    (result,) = run_distributed(_attention_with_masks, world_size=1)
    assert result["default_is_fused_kernel"] and result["default_mask_close"] <= 1e-6
    assert result["explicit_mask_equal"]
    assert result["mask_matters"] > 1e-3


def test_fused_adam_matches_torch_adam() -> None:
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(7, 5, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in init] for _ in range(4)]
    params = {}
    for fuse in (False, True):
        ps = [torch.nn.Parameter(p.clone()) for p in init]
        optimizer = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        if fuse:
            use_fused_torch_adam(optimizer)
            assert all(group["fused"] for group in optimizer.param_groups)
        for step_grads in grads:
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        params[fuse] = ps
    for fused, plain in zip(params[True], params[False], strict=True):
        assert (fused - plain).abs().max() <= 1e-6
        assert (fused - init[0 if fused.dim() == 2 else 1]).abs().max() > 1e-3  # the steps moved it


def _grad_reduce_at_one_rank() -> dict[str, bool]:
    from megatron.core.distributed import param_and_grad_buffer as buffers

    with ParallelContext.initialize(ParallelConfig()) as ctx:
        reduce_scatter = buffers.dist_reduce_scatter_func
        grads = torch.arange(6.0)
        skipped = reduce_scatter(grads[0:6], grads, group=ctx.dp_group) is None
        out = torch.zeros(6)
        reduce_scatter(out, grads, group=ctx.dp_group)  # not a self-copy: the real collective runs
        return {
            "skipped": skipped,
            "unchanged": torch.equal(grads, torch.arange(6.0)),
            "copied": torch.equal(out, grads),
        }


def test_one_rank_grad_reduce_skips_only_the_self_copy(run_distributed) -> None:
    (result,) = run_distributed(_grad_reduce_at_one_rank, world_size=1)
    assert result == {"skipped": True, "unchanged": True, "copied": True}
