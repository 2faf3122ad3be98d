"""DPO loss and gradients on the megatron engine equal a direct computation with ``transformers`` on the same
tiny model and pairs, within 1e-5 in fp32, at TP1 (x DP4), TP2 x PP2 and TP2 + SP (x DP2; sequences padded
to a multiple of TP), for every loss type.

The oracle below is written from TRL's definitions (summed completion log-probs from HF logits, the loss per
pair, the mean over pairs) and does not use ``mcore_rl.algo.dpo``. One call on the 4-rank pool covers every
case at both layouts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.algo import DPOSettings
from mcore_rl.config import OptimConfig
from mcore_rl.data.preference import PreferenceBatch, PreferenceDataset, PreferenceRecord
from mcore_rl.dpo.loss import DPOLossSettings, dpo_pair_loss
from mcore_rl.engine.arch import ModelArch
from tests.convert.hf_models import build_hf_model

NUM_PAIRS = 4
# (name, settings, sft_loss_weight)
CASES: list[tuple[str, DPOSettings, float]] = [
    ("sigmoid", DPOSettings(beta=0.1), 0.0),
    ("cdpo", DPOSettings(beta=0.1, label_smoothing=0.1), 0.0),
    ("robust", DPOSettings(beta=0.2, loss_type="robust", label_smoothing=0.2), 0.0),
    ("hinge", DPOSettings(beta=0.5, loss_type="hinge"), 0.0),
    ("ipo", DPOSettings(beta=0.5, loss_type="ipo"), 0.0),  # loss ~1: fp32 rounding well under 1e-5
    ("reference_free", DPOSettings(beta=0.1, reference_free=True), 0.0),
    ("sigmoid+sft", DPOSettings(beta=0.1), 0.5),
]
LAYOUTS = [(1, 1, False), (2, 2, False), (2, 1, True)]  # (TP, PP, SP) on 4 ranks: DP4, DP1, DP2


def _records(vocab: int) -> list[PreferenceRecord]:
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(1, vocab, (n,), generator=gen).tolist())

    return [PreferenceRecord(ids(3 + i), ids(2 + i % 3), ids(5 - i % 2)) for i in range(NUM_PAIRS)]


# --- the oracle: transformers -----------------------------------------------------------------------------------


def _hf_sequence_logps(model: Any, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch.tokens).logits.float()
    labels = torch.roll(batch.tokens, -1, dims=1)
    token = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    return (token * batch.loss_mask).sum(1), batch.loss_mask.sum(1)


def _trl_loss(logps, ref, lengths, settings: DPOSettings, sft: float) -> torch.Tensor:
    b, beta, eps = NUM_PAIRS, settings.beta, settings.label_smoothing
    nll = -logps[:b] / lengths[:b]  # each chosen completion's per-token NLL (the RPO paper's form; not TRL's)
    if settings.reference_free:
        ref = torch.zeros_like(ref)
    if settings.loss_type.value == "ipo":
        logps, ref = logps / lengths, ref / lengths
    delta = (logps[:b] - ref[:b]) - (logps[b:] - ref[b:])
    kind = settings.loss_type.value
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif kind == "robust":
        losses = (-F.logsigmoid(beta * delta) * (1 - eps) + F.logsigmoid(-beta * delta) * eps) / (1 - 2 * eps)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        losses = (delta - 1 / (2 * beta)) ** 2
    return (losses + sft * nll).mean()


def _hf_oracle(policy: Any, reference: Any, batch: PreferenceBatch) -> dict[str, Any]:
    from mcore_rl.engine.hf.mapping import tensor_maps, to_full

    arch = ModelArch.from_hf_config(policy.config.to_dict())
    with torch.no_grad():
        ref, _ = _hf_sequence_logps(reference, batch)
    out = {}
    for name, settings, sft in CASES:
        policy.zero_grad()
        logps, lengths = _hf_sequence_logps(policy, batch)
        loss = _trl_loss(logps, ref, lengths, settings, sft)
        loss.backward()
        grads = dict(policy.named_parameters())
        full = {m.full_name: to_full(arch, m, [grads[n].grad for n in m.hf_names]) for m in tensor_maps(arch)}
        out[name] = (loss.item(), full)
    return out


# --- the engine, on every rank ----------------------------------------------------------------------------------


def _engine_grads(engine: Any, arch: ModelArch, ctx: Any) -> dict[str, torch.Tensor]:
    """The DP-reduced gradient as a full state (main_grad swapped into the weights for the gather)."""
    from mcore_rl.engine.weights import gather_full_state

    params = [p for chunk in engine.models for p in chunk.parameters()]
    saved = [p.data.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data.copy_(p.main_grad)
        full = gather_full_state(engine.models, arch, ctx)
        for p, data in zip(params, saved, strict=True):
            p.data.copy_(data)
    return full


def _layout_cases(policy_dir: str, reference_dir: str, tp: int, pp: int, sp: bool) -> dict[str, Any] | None:
    import torch.distributed as dist

    from mcore_rl.dpo.policy import DPOPolicy, PolicySpec, _stack, shard_indices
    from mcore_rl.engine.hf.state import load_hf_full_state
    from mcore_rl.engine.weights import load_full_state
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    arch = ModelArch.from_hf_config(str(Path(policy_dir) / "config.json"))
    dataset = PreferenceDataset(_records(arch.vocab_size), pad_token_id=0)
    optim = OptimConfig(lr=0.0, weight_decay=0.0, use_distributed_optimizer=False)
    out = {}
    with ParallelContext.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    ) as ctx:
        micro_pairs = NUM_PAIRS // ctx.dp_size // 2 or 1  # PP runs two micro-batches
        loss0 = DPOLossSettings(CASES[0][1], arch.vocab_size)
        spec = PolicySpec(arch, optim, 1, loss0, micro_pairs, with_reference=True)
        policy = DPOPolicy.build(ctx, spec, load_hf_full_state(policy_dir, arch))
        assert policy.reference is not None
        load_full_state(policy.reference.models, load_hf_full_state(reference_dir, arch), arch, ctx)
        mine, weights = shard_indices(range(NUM_PAIRS), ctx, micro_pairs)
        for name, settings, sft in CASES:
            micro = policy.micro_batches(dataset.batch(mine, policy.width_multiple), weights, None)
            policy.fill_reference(micro)
            loss_fn = dpo_pair_loss(DPOLossSettings(settings, arch.vocab_size, sft), ctx, torch.tensor(4.0))
            policy.engine.zero_grad()
            metrics = policy.engine.forward_backward(list(micro), loss_fn)
            loss = policy._share(_stack(metrics), bool(metrics))["loss"]
            out[name] = (loss, _engine_grads(policy.engine, arch, ctx))
    return out if dist.get_rank() == 0 else None


def _all_layouts(policy_dir: str, reference_dir: str) -> dict[tuple[int, int, bool], Any] | None:
    results = {layout: _layout_cases(policy_dir, reference_dir, *layout) for layout in LAYOUTS}
    return results if results[LAYOUTS[0]] is not None else None


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Any, Any]:
    root = tmp_path_factory.mktemp("dpo_parity")
    policy, reference = build_hf_model("llama", seed=0), build_hf_model("llama", seed=1)
    policy.save_pretrained(root / "policy")
    reference.save_pretrained(root / "reference")
    return str(root / "policy"), str(root / "reference"), policy.float(), reference.float()


def test_loss_and_grads_match_transformers(run_distributed, hf_pair) -> None:
    policy_dir, reference_dir, policy, reference = hf_pair
    records = _records(policy.config.vocab_size)
    oracle = _hf_oracle(policy, reference, PreferenceBatch.from_records(records, pad_token_id=0))
    assert all(math.isfinite(loss) and loss > 0 for loss, _ in oracle.values())
    results = run_distributed(_all_layouts, policy_dir, reference_dir, world_size=4, timeout_s=600)[0]
    worst = {}
    for layout, cases in results.items():
        for name, (loss, grads) in cases.items():
            want_loss, want_grads = oracle[name]
            assert sorted(grads) == sorted(want_grads)
            grad_diff = max(float((grads[k] - want_grads[k]).abs().max()) for k in grads)
            worst[(layout, name)] = (abs(loss - want_loss), grad_diff)
            assert abs(loss - want_loss) < 1e-5, (layout, name, loss, want_loss)
            assert grad_diff < 1e-5, (layout, name, grad_diff)
            # Not vacuous: every case moves the weights.
            assert max(float(g.abs().max()) for g in want_grads.values()) > 1e-3, name
    print("max |diff| (loss, grad) per (layout, case):", worst)
