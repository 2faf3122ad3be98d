"""LoRA against peft on the same HF model: logits, loss and every adapter's gradient within 1e-5 (fp32) at TP1
(DP2), TP2 with sequence parallelism and PP2, and the layouts' adapter gradients within 1e-5 of each other; the
base frozen (no gradient buffer, no optimizer state). A mixture-of-experts model's attention at EP2 the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_rl.engine.hf.mapping import tensor_maps, to_full
from mcore_rl.engine.hf.peft import full_name
from mcore_rl.engine.lora import gather_adapter_state, load_adapter_state
from mcore_rl.engine.lora_spec import LoRASpec, resolve_targets
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import LabeledMicroBatch, tiny_arch

RANK, ALPHA, SEQ, BATCH = 4, 8.0, 16, 2
TOL = 1e-5
LAYOUTS = {
    "tp1-dp2": {},
    "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def peft_reference(targets: str | list[str], seed: int = 0, family: str = "llama", **overrides: Any) -> dict:
    """peft on transformers' ``family`` (Llama by default): the base's full state, peft's adapters (full-state
    names, random B so the update is not zero), logits, the mean next-token loss and the adapters' gradients."""
    import peft

    from tests.convert.hf_models import build_hf_model

    model = build_hf_model(family, seed=seed, **overrides)
    arch = tiny_arch(family, **overrides)
    hf = _saved_state(model) if arch.moe else {k: v.detach().clone() for k, v in model.state_dict().items()}
    base = {m.full_name: to_full(arch, m, [hf[n] for n in m.hf_names]) for m in tensor_maps(arch)}
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed + 1)
    adapters = {}
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
                adapters[full_name(name.replace(".default", ""))] = param.detach().clone()
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=generator)
    logits = wrapped(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, arch.vocab_size), torch.roll(tokens, -1, 1).reshape(-1)
    )
    loss.backward()
    grads = {
        full_name(n.replace(".default", "")): p.grad.clone()
        for n, p in wrapped.named_parameters()
        if "lora_" in n
    }
    assert None not in adapters and None not in grads
    return {
        "model": (family, overrides),
        "base": base,
        "adapters": adapters,
        "tokens": tokens,
        "logits": logits.detach(),
        "loss": loss.item(),
        "grads": grads,
    }


def _saved_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` writes them: transformers 5 keeps a MoE layer's experts fused in
    memory and writes each expert's projections, the names a checkpoint (and our mapping) has."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return load_file(f"{folder}/model.safetensors")


def _ce(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )

    shard = output.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * shard
    logits = output.float().masked_fill(torch.arange(first, first + shard) >= mb.vocab_size, float("-inf"))
    per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), mb.labels.t().contiguous())
    loss = per_token.sum() / (BATCH * SEQ)
    full = gather_from_tensor_model_parallel_region(output.float())[..., : mb.vocab_size]
    return loss, {"loss": loss.detach(), "logits": full.detach()}


def lora_step(parallel: dict, reference: dict, targets: str | list[str]) -> dict:
    """Our forward-backward on ``reference``'s weights, batch split over DP: logits, loss, adapter grads, and
    what the frozen base holds (gradient buffers, optimizer state)."""
    import torch.distributed as dist

    family, overrides = reference["model"]
    arch = tiny_arch(family, **overrides)
    spec = LoRASpec(rank=RANK, alpha=ALPHA, targets=resolve_targets(targets))
    optim = OptimConfig(lr=0.0, weight_decay=0.0, use_distributed_optimizer=False)
    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(lora=spec), optim)
        engine.load_full_state(reference["base"])
        load_adapter_state(engine.chunks, reference["adapters"], arch, ctx, "peft")
        tokens = reference["tokens"].chunk(ctx.dp_size)[ctx.dp_rank]
        positions = torch.arange(SEQ).expand_as(tokens)
        batch = LabeledMicroBatch(
            tokens, positions, labels=torch.roll(tokens, -1, 1), vocab_size=arch.vocab_size
        )
        engine.zero_grad()
        out = engine.forward_backward([batch], _ce)
        loss = torch.tensor([float(out[0]["loss"]) if out else 0.0])
        dist.all_reduce(loss, group=ctx.dp_group)
        grads = gather_adapter_state(engine.chunks, arch, ctx, grads=True)
        trainable = {n for m in engine.models for n, p in m.named_parameters() if p.requires_grad}
        in_buffers = sum(b.numel_unpadded for c in engine.chunks for b in c.buffers)
        optimized = {p for o in engine.optimizers for g in o.param_groups for p in g["params"]}
        adapter_numel = sum(p.numel() for m in engine.models for n, p in m.named_parameters() if "lora_" in n)
        return {
            "logits": out[0]["logits"] if out else None,
            "dp_rank": ctx.dp_rank,
            "loss": float(loss),
            "grads": grads,
            "trainable_base": sorted(n for n in trainable if "lora_" not in n),
            "buffer_numel": in_buffers,
            "adapter_numel": adapter_numel,
            "optimized_numel": sum(p.numel() for p in optimized),  # a DP shard with the distributed optimizer
        }


@pytest.fixture(scope="module")
def all_linear():
    return peft_reference("all-linear")


def _check(results: list[dict], reference: dict) -> None:
    rows = reference["logits"].chunk(len({r["dp_rank"] for r in results}))
    for result in results:
        assert result["trainable_base"] == []  # the base is frozen
        assert result["buffer_numel"] == result["adapter_numel"]  # DDP buffers hold the adapters' grads only
        assert 0 < result["optimized_numel"] <= result["adapter_numel"]  # no optimizer state for the base
        if result["logits"] is not None:
            expected = rows[result["dp_rank"]]
            assert (result["logits"] - expected).abs().max() <= TOL
            assert abs(result["loss"] - reference["loss"]) <= TOL  # summed over DP
        assert result["grads"].keys() == reference["grads"].keys()
        worst = max((result["grads"][k] - g).abs().max().item() for k, g in reference["grads"].items())
        assert worst <= TOL, worst


def every_layout(reference: dict) -> list[dict]:
    return [lora_step(parallel, reference, "all-linear") for parallel in LAYOUTS.values()]


def test_forward_and_adapter_grads_equal_peft_and_agree_across_layouts(run_distributed, all_linear):
    by_rank = run_distributed(every_layout, all_linear)  # [rank][layout]
    per_layout = [list(results) for results in zip(*by_rank, strict=True)]
    for name, results in zip(LAYOUTS, per_layout, strict=True):
        _check(results, all_linear)
        assert max(r["grads"][k].abs().max().item() for r in results for k in r["grads"]) > 1e-3, name
    grads = [
        results[0]["grads"] for results in per_layout
    ]  # full (gathered) gradients, the same on every rank
    worst = max((g[k] - grads[0][k]).abs().max().item() for g in grads[1:] for k in grads[0])
    assert worst <= TOL, worst  # layout parity: TP2+SP and PP2 against TP1xDP2


def test_some_projections_of_the_fused_layers(run_distributed):
    """q and v of the fused QKV (k's rows stay the base's), up of [gate; up], and down: at TP2 without SP
    (the column adapters' copy-to-TP path)."""
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    reference = peft_reference(targets, seed=3)
    assert {k.split(".lora_")[1].split(".")[1] for k in reference["grads"]} == set(targets)
    _check(run_distributed(lora_step, {"tensor_model_parallel_size": 2}, reference, targets), reference)


def test_a_mixture_of_experts_models_attention_with_its_experts_over_two_ranks(run_distributed):
    """Qwen3-MoE (top-2 of 4 experts, layer 1 dense): adapters on the attention, the experts frozen and split
    over two expert-parallel ranks. No load-balancing loss: transformers' forward leaves it out, and megatron's
    would reach the attention adapters' gradients through the routers' inputs."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    reference = peft_reference(targets, seed=5, family="qwen3_moe", router_aux_loss_coef=0.0)
    _check(run_distributed(lora_step, {"expert_model_parallel_size": 2}, reference, targets), reference)
