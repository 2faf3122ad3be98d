"""A decode step's projections on this CPU: our column panels, MKL's packed GEMM and oneDNN's GEMM (what
prefill runs on AMD CPUs with AVX-512, ``ops.gemm``) against ATen's plain GEMM.

The embedded engine's decode steps multiply a few rows (one token per sequence) by every weight of a layer and
by the LM head. Which packed form runs them is decided per machine by ``projection.panels_pay``: our panels
everywhere but on Intel CPUs with AVX-512, where MKL's packed GEMM measured faster. This script times the
forms at the workloads' shapes (one layer's QKV, output, gate-up and down projections plus the LM head,
each weight packed once as the decoder packs it) and prints each form's time and its ratio to the baseline,
ATen's plain GEMM on the same weight (``torch.mm`` on column-major storage, what a decode step runs without
packing), measured in the same run, alternating per shape. On a CPU with AVX-512 the panels run their
AVX-512 kernel; ``panels_avx2`` times the same panels on the AVX2 kernel (``MCORE_RL_DECODE_ISA=avx2``).

    python -m bench.bench_decode_projections [--threads 1 2] [--rows 8 32 128]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from bench._rollout_models import model_config
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import rollout_param_shapes
from mcore_rl.engine.rollout.projection import panels_pay
from mcore_rl.io.host import cpu_vendor
from mcore_rl.ops import decode as fused
from mcore_rl.ops.gemm import onednn_available

# the workloads' models: bench_train's tiny (multi-head, issue 17's), the realistic one, Qwen2.5-0.5B's shape
MODELS = {"tiny": {"kv_heads": 8}, "realistic": {}, "qwen05b": {}}
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def decode_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(in, out) of layer 0's projections and the LM head, as the rollout layout holds them (vocab padded)."""
    arch = ModelArch.from_hf_config(model_config(model, **MODELS[model]))
    shapes = rollout_param_shapes(arch, 1)
    head = "embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    names = {p.split(".")[-1]: f"layers.0.{p}.weight" for p in _PROJECTIONS} | {"head": head}
    return {short: (shapes[name][1], shapes[name][0]) for short, name in names.items()}


def _seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def layer_seconds(shapes: dict[str, tuple[int, int]], rows: int) -> dict[str, float]:
    """Seconds of one layer's projections plus the head, per form, the forms alternating per shape."""
    total = {"plain": 0.0, "onednn": 0.0, "mkl_packed": 0.0, "panels": 0.0, "panels_avx2": 0.0}
    wide = torch.backends.cpu.get_cpu_capability() == "AVX512"
    onednn = onednn_available()
    for k, n in shapes.values():
        weight_t = torch.randn(k, n) * 0.02  # [in, out] contiguous: the column-major view of [out, in]
        x = torch.randn(rows, k)
        reps = max(3, int(2e6 / (k * n)))
        mkl = fused.mkl_pack(weight_t, rows) if fused.mkl_packing_available(x.device, x.dtype) else None
        panels = fused.pack_panels(weight_t) if fused.packing_enabled(x.device, x.dtype) else None
        total["plain"] += _seconds(partial(torch.mm, x, weight_t), reps)
        if onednn:  # oneDNN's GEMM, what prefill runs on AMD CPUs with AVX-512 (``ops.gemm``)
            total["onednn"] += _seconds(partial(torch.ops.mcore_rl.gemm, x, weight_t, None), reps)
        if mkl is not None:
            total["mkl_packed"] += _seconds(
                partial(fused.mkl_linear, x, mkl, weight_t, None, rows=rows), reps
            )
        if panels is not None:
            total["panels"] += _seconds(partial(fused.decode_linear, x, panels, n, None), reps)
        if panels is not None and wide:
            os.environ["MCORE_RL_DECODE_ISA"] = "avx2"
            total["panels_avx2"] += _seconds(partial(fused.decode_linear, x, panels, n, None), reps)
            del os.environ["MCORE_RL_DECODE_ISA"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    args = parser.parse_args()
    chosen = "panels" if panels_pay(torch.device("cpu"), torch.float32) else "MKL's packed GEMM (2+ threads)"
    print(
        f"CPU {cpu_vendor() or 'unknown'}, ATen {torch.backends.cpu.get_cpu_capability()}; the decoder picks "
        f"{chosen}. One layer's projections + LM head, ms; ratio = plain GEMM / form (higher is faster)"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        for model in args.models:
            for rows in args.rows:
                t = layer_seconds(decode_shapes(model), rows)
                cells = "  ".join(
                    f"{form} {s * 1e3:8.3f} ms ({t['plain'] / s:.2f}x)" for form, s in t.items() if s > 0
                )
                print(f"  {threads} thr {model:10s} {rows:4d} rows: {cells}", flush=True)


if __name__ == "__main__":
    main()
