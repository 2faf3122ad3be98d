"""Reshard pack kernel against torch.cat + copy: gathering megatron TP shards of Llama-shaped layers into
a rollout bucket (fp32 training weights -> bf16 rollout weights).

Baseline, in the same run: verl's gather (per-shard split of the fused QKV and gate/up, ``torch.cat`` of
the pieces into full q, k, v, gate, up, and of row-/column-parallel shards), then vLLM's loader narrowing
each full tensor to the rollout rank and ``copy_``-ing (with the cast) into the bucket. The baseline writes
straight into the bucket's views, with no extra concatenation, to be as favourable to it as possible.
Fused: one ``pack_copy`` of a precomputed table (``PackPlan``). Both produce bit-identical buckets (checked).

Times are medians of interleaved repetitions (absolute times on a shared machine are noisy; the ratio is
taken under the same load). Peak memory: see _measure.py.

    python bench/bench_pack.py [--model 1b|8b] [--layers 2] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _measure import child_peak, median_seconds, mib, peak_extra_bytes

from mcore_rl.ops import PackPlan, native_available

# hidden, heads, kv heads (query groups), head dim, ffn: Llama-3.2-1B and Llama-3-8B.
MODELS = {"1b": (2048, 32, 8, 64, 8192), "8b": (4096, 32, 8, 128, 14336)}
SCENARIOS = [(2, 1), (4, 2), (2, 4)]  # (training tp, rollout tp); the bucket is rollout rank 0's


def _shards(model: str, layers: int, src_tp: int) -> list[dict[str, list[torch.Tensor]]]:
    hidden, heads, groups, hd, ffn = MODELS[model]
    gen = torch.Generator().manual_seed(0)

    def shards(*shape: int) -> list[torch.Tensor]:
        return [torch.randn(*shape, generator=gen) for _ in range(src_tp)]

    qkv_rows = groups // src_tp * (heads // groups + 2) * hd
    return [
        {
            "qkv": shards(qkv_rows, hidden),
            "proj": shards(hidden, heads * hd // src_tp),
            "fc1": shards(2 * ffn // src_tp, hidden),
            "fc2": shards(hidden, ffn // src_tp),
            "norm": [torch.randn(hidden, generator=gen)],
        }
        for _ in range(layers)
    ]


def _plan(model: str, layers: int, src_tp: int, dst_tp: int) -> PackPlan:
    hidden, heads, groups, hd, ffn = MODELS[model]
    plan = PackPlan(src_tp=src_tp, dst_tp=dst_tp, dst_rank=0)
    for i in range(layers):
        plan.add_qkv(f"{i}.qkv", num_heads=heads, num_query_groups=groups, head_dim=hd, columns=hidden)
        plan.add_row_parallel(f"{i}.proj", rows=hidden, columns=heads * hd)
        plan.add_gated_fc1(f"{i}.fc1", ffn_hidden_size=ffn, columns=hidden)
        plan.add_row_parallel(f"{i}.fc2", rows=hidden, columns=ffn)
        plan.add_replicated(f"{i}.norm", shape=(hidden,))
    return plan


def _naive_pack(model: str, layer_shards: list, views: dict[str, torch.Tensor], dst_tp: int) -> None:
    """verl-style torch.cat gather, then vLLM-style narrow + copy_ (with the cast) into the bucket views."""
    _, heads, groups, hd, _ = MODELS[model]
    per_group = heads // groups
    q_rows, kv_rows = heads // dst_tp * hd, max(1, groups // dst_tp) * hd
    for i, layer in enumerate(layer_shards):
        split = [
            s.view(-1, per_group + 2, hd, s.shape[1]).split([per_group, 1, 1], dim=1) for s in layer["qkv"]
        ]
        q, k, v = (
            torch.cat([part[j].reshape(-1, s.shape[1]) for part, s in zip(split, layer["qkv"], strict=True)])
            for j in range(3)
        )
        out = views[f"{i}.qkv"]
        out[:q_rows].copy_(q[:q_rows])
        out[q_rows : q_rows + kv_rows].copy_(k[:kv_rows])
        out[q_rows + kv_rows :].copy_(v[:kv_rows])
        gate = torch.cat([s.chunk(2)[0] for s in layer["fc1"]])
        up = torch.cat([s.chunk(2)[1] for s in layer["fc1"]])
        f = gate.shape[0] // dst_tp
        views[f"{i}.fc1"][:f].copy_(gate[:f])
        views[f"{i}.fc1"][f:].copy_(up[:f])
        for name in ("proj", "fc2"):
            full = torch.cat(layer[name], dim=1)
            views[f"{i}.{name}"].copy_(full[:, : full.shape[1] // dst_tp])
        views[f"{i}.norm"].copy_(layer["norm"][0])


def _variants(model: str, layers: int, src_tp: int, dst_tp: int):
    layer_shards = _shards(model, layers, src_tp)
    plan = _plan(model, layers, src_tp, dst_tp)
    table = plan.table()
    sources = [t for layer in layer_shards for ts in layer.values() for t in ts]
    buckets = {v: torch.empty(plan.numel, dtype=torch.bfloat16) for v in ("naive", "fused")}
    return (
        {
            "naive": lambda: _naive_pack(model, layer_shards, plan.views(buckets["naive"]), dst_tp),
            "fused": lambda: plan.pack(sources, buckets["fused"], table),
        },
        buckets,
        sum(s.numel() for s in sources),
    )


def _child(argv: list[str]) -> None:
    model, layers, src_tp, dst_tp, variant = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    fns, _, _ = _variants(model, layers, src_tp, dst_tp)
    fns[variant]()
    print(json.dumps({"peak": peak_extra_bytes(fns[variant])}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not native_available():
        print("warning: mcore_rl._C is not built; 'fused' runs the pure-PyTorch reference")
    hidden, heads, groups, hd, ffn = MODELS[args.model]
    print(
        f"Llama-{args.model} layer shapes (hidden {hidden}, {heads} heads / {groups} kv, head dim {hd}, ffn {ffn}),"
    )
    print(
        f"{args.layers} layers, fp32 shards -> bf16 bucket of rollout rank 0, {torch.get_num_threads()} threads"
    )
    print(
        f"{'tp -> tp_g':11} {'source':>11} {'naive':>9} {'fused':>9} {'speed-up':>9} {'naive peak extra':>17} "
        f"{'fused peak extra':>17}"
    )
    for src_tp, dst_tp in SCENARIOS:
        fns, buckets, numel = _variants(args.model, args.layers, src_tp, dst_tp)
        times = median_seconds(fns, args.reps)
        assert torch.equal(buckets["naive"], buckets["fused"]), "fused bucket differs from the torch.cat one"
        del fns, buckets
        peaks = {
            v: child_peak(__file__, [args.model, str(args.layers), str(src_tp), str(dst_tp), v])["peak"]
            for v in ("naive", "fused")
        }
        print(
            f"{src_tp} -> {dst_tp:<6} {mib(numel * 4)} {times['naive'] * 1e3:7.1f}ms {times['fused'] * 1e3:7.1f}ms "
            f"{times['naive'] / times['fused']:8.2f}x {mib(peaks['naive']):>17} {mib(peaks['fused']):>17}"
        )


if __name__ == "__main__":
    main()
