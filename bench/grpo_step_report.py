"""The GRPO step bench's report (``bench_grpo_step.py``): the timed rounds of every side reduced to one
JSON-ready record (medians and min-max spreads, ratios round by round, each phase against its limit from
``grpo_step_limits.py``, peak RSS per phase, the weight sync against memcpy), and that record printed.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.grpo_step_limits import param_count, phase_limits, step_flops
from mcore_rl.engine.arch import ModelArch

PHASES = ("sync", "generate", "to_train", "log_probs", "update", "optimizer")
"""The report's phases, in step order; a baseline's ``forward_backward`` is its ``update``."""
PHASE_OF = {"forward_backward": "update"}


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratio(num: list[dict[str, float]], den: list[dict[str, float]]) -> dict[str, Any]:
    """Step-time ratios of two sides, round by round (each round's pair ran back to back)."""
    per_round = [a["step"] / b["step"] for a, b in zip(num, den, strict=True)]
    return {"per_round": per_round, **_stats(per_round)}


def _side_record(
    rows: list[dict[str, float]], tokens: int, limits: dict[str, float], compute_limit_s: float
) -> dict[str, Any]:
    """One side's figures over the timed rounds: step and phase seconds, tokens/s, % of the limits, peak RSS
    per phase (the most of any round)."""
    phases = {
        PHASE_OF.get(k, k): _stats([r[k] for r in rows]) for k in rows[0] if k != "step" and ":" not in k
    }
    rss = {
        PHASE_OF.get(k[4:], k[4:]): max(r[k] for r in rows) / 2**20 for k in rows[0] if k.startswith("rss:")
    }
    step = _stats([r["step"] for r in rows])
    return {
        "step_s": step,
        "phases_s": phases,
        "tokens_per_s": _stats([tokens / r["step"] for r in rows]),
        "compute_limit_percent": 100 * compute_limit_s / step["median"],
        "phase_limit_percent": {k: 100 * limits[k] / v["median"] for k, v in phases.items() if k in limits},
        "peak_rss_mib": rss,
    }


def report_record(
    args: argparse.Namespace,
    arch: ModelArch,
    rows: dict[str, list[dict[str, float]]],
    labels: dict[str, str],
    gflops: dict[str, float],
    sync: dict[str, Any],
) -> dict[str, Any]:
    """Everything the report prints, as one JSON-ready object (``--json``)."""
    n = args.prompts * args.n
    flops = step_flops(arch, n, args.prompt_len, args.new_tokens, args.n)
    copy_rate = sync["copy_bytes_per_s"]
    # a limit counts the work the step needs: with each prompt once per group, what ours computes
    needed = (
        {**flops, "log_probs": flops["log_probs_shared"], "update": flops["update_shared"]}
        if args.share_prompt_prefix
        else flops
    )
    limits = phase_limits(needed, gflops, copy_rate, param_count(arch), sync["bytes"])
    compute_limit_s = limits["generate"] + limits["update"]
    sides = {
        name: {"label": labels[name], **_side_record(r, n * args.new_tokens, limits, compute_limit_s)}
        for name, r in rows.items()
    }
    pairs = [("trl", "ours"), ("hf", "ours"), ("trl", "hf"), ("ours_always", "ours")]
    ratios = {f"{a}/{b}": _ratio(rows[a], rows[b]) for a, b in pairs if a in rows and b in rows}
    sync_s = sides["ours"]["phases_s"]["sync"]["median"]
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "hf_config"},
        "model": {"name": args.model, "hf_config": args.hf_config, "params": param_count(arch)},
        "workload": {"sequences": n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "sides": sides,
        "ratios": ratios,
        "limits": {
            "flops": flops,
            "gemm_gflop_per_s": gflops,
            "copy_gb_per_s": copy_rate / 1e9,
            "phase_s": limits,
            "compute_s": compute_limit_s,
        },
        "sync": {
            "bytes": sync["bytes"],
            "seconds": sync_s,
            "gb_per_s": sync["bytes"] / sync_s / 1e9,
            "copy_gb_per_s": copy_rate / 1e9,
            "percent_of_copy": 100 * sync["bytes"] / sync_s / copy_rate,
            "transition_steps_s": sync["steps_s"],
        },
    }


def _spread(stats: dict[str, float], digits: int = 3) -> str:
    return (
        f"median {stats['median']:.{digits}f} (min {stats['min']:.{digits}f}, max {stats['max']:.{digits}f})"
    )


def _times(side: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v['median']:.3f}s" for k, v in side["phases_s"].items())
    return f"step {side['step_s']['median']:.3f}s, {phases}"


def print_report(record: dict[str, Any]) -> None:
    args, sides, limits = record["args"], record["sides"], record["limits"]
    a, w = ModelArch.from_hf_config(record["model"]["hf_config"]), record["workload"]
    print(
        f"workload: {args['model']} model (h{a.hidden_size}, {a.num_layers} layers, {a.num_attention_heads} "
        f"heads / {a.num_query_groups} KV heads, ffn {a.ffn_hidden_size}, vocab {a.vocab_size}, "
        f"{record['model']['params'] / 1e6:.1f}M params, fp32): {w['sequences']} sequences x "
        f"({w['prompt_len']} + {w['new_tokens']}) tokens, {args['threads']} threads"
    )
    baselines = [k for k in ("trl", "hf") if k in sides]
    print(f"baseline ran: {' and '.join(sides[k]['label'] for k in baselines)}")
    for name, side in sides.items():
        print(f"{name + ':':12} {_times(side)}")
    print(
        "tokens/s (sequences x new tokens / step, median): "
        + ", ".join(f"{name} {side['tokens_per_s']['median']:.0f}" for name, side in sides.items())
    )
    _print_limits(record)
    for name, ratio in record["ratios"].items():
        print(f"ratio {name} (per round): {_spread(ratio)}")
    for name, side in sides.items():
        print(f"{name} vs compute limit: {side['compute_limit_percent']:.0f}% of the limit")
    _print_phase_tables(sides, limits["phase_s"])
    sync = record["sync"]
    print(
        f"sync: {sync['bytes'] / 2**20:.1f} MiB in {sync['seconds'] * 1e3:.1f} ms = {sync['gb_per_s']:.2f} GB/s, "
        f"memcpy {sync['copy_gb_per_s']:.2f} GB/s ({sync['percent_of_copy']:.0f}% of it); last sync's steps: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sync["transition_steps_s"].items())
    )


def _print_limits(record: dict[str, Any]) -> None:
    flops, limits = record["limits"]["flops"], record["limits"]
    print(
        f"step FLOPs: generate {flops['generate'] / 1e9:.2f} G (each prompt prefilled once), log-probs (forward) "
        f"{flops['log_probs'] / 1e9:.2f} G, update (forward + backward) {flops['update'] / 1e9:.2f} G; "
        "LM head included"
    )
    if record["args"]["share_prompt_prefix"]:
        print(
            f"  ours computes update {flops['update_shared'] / 1e9:.2f} G of them (each prompt once per group, "
            "model.share_prompt_prefix), which the limits count: the work the step needs"
        )
    rates = limits["gemm_gflop_per_s"]
    print(
        f"fastest fp32 GEMM (torch.mm or oneDNN), best round: {rates['decode']:.1f} GFLOP/s at decode shapes, "
        f"{rates['train']:.1f} GFLOP/s at training shapes (forward, input and weight gradients, LM head included); "
        f"Tensor.copy_ {limits['copy_gb_per_s']:.2f} GB/s"
    )
    print(f"compute limit of the step (generate + update): {limits['compute_s']:.3f}s")


def _print_phase_tables(sides: dict[str, Any], limits: dict[str, float]) -> None:
    names = list(sides)
    print("phase vs its own limit (median s, % of the limit):")
    print(f"  {'phase':10} {'limit':>9}" + "".join(f" {n:>20}" for n in names))
    for phase in PHASES:
        cells = []
        for name in names:
            seconds = sides[name]["phases_s"].get(phase, {}).get("median")
            percent = sides[name]["phase_limit_percent"].get(phase)
            cell = (
                "-"
                if seconds is None
                else f"{seconds:.3f}s" + (f" ({percent:.0f}%)" if percent is not None else "")
            )
            cells.append(f" {cell:>20}")
        limit = f"{limits[phase]:.3f}s" if phase in limits else "-"
        print(f"  {phase:10} {limit:>9}" + "".join(cells))
    with_rss = [n for n in names if sides[n]["peak_rss_mib"]]
    print("peak RSS per phase (MiB, the most of any timed round):")
    print(f"  {'phase':10}" + "".join(f" {n:>12}" for n in with_rss))
    for phase in PHASES:
        values = [sides[n]["peak_rss_mib"].get(phase) for n in with_rss]
        if any(v is not None for v in values):
            print(f"  {phase:10}" + "".join(f" {'-' if v is None else f'{v:.0f}':>12}" for v in values))
