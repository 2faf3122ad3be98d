"""Mixture-of-experts cost through ``mcore-rl train``: the MoE demo recipe (``recipes/moe_demo_cpu.yaml``: 4
experts of 256, top-2) at expert parallelism 1 and 2, against the dense demo model of the same active size
(``recipes/demo_cpu.yaml``'s 512-wide MLP: two experts of 256 per token), all on 2 Ray workers (DP2).

Each variant runs ``--steps`` RL steps (no SFT, no validation, no checkpoints) as a fresh run, in rotation for
``--rounds`` rounds; the report gives the median step time after ``--warmup`` steps, the weight sync's reshard
time and the bytes each rank receives per step (``sync/received_bytes``, the plan's minimum), with the spread over
rounds and EP2 / EP1 and MoE / dense ratios. Step times on a shared machine are noisy; the ratios within one
run are the figures that count.

    python bench/bench_moe.py [--steps 20] [--warmup 5] [--rounds 3] [--out runs/bench_moe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "moe-ep1": ["moe_demo_cpu", "parallel.expert_model_parallel_size=1"],
    "moe-ep2": ["moe_demo_cpu", "parallel.expert_model_parallel_size=2"],
    "dense": ["demo_cpu", "trainer.n_gpus_per_node=2", "algorithm.ppo_micro_batch_size_per_gpu=32"],
}


def run(name: str, args: argparse.Namespace, round_index: int) -> dict[str, float]:
    """One fresh run of a variant; medians of its steps after the warm-up."""
    recipe, *overrides = VARIANTS[name]
    folder = os.path.join(args.out, f"{name}-r{round_index}-{int(time.time())}")
    data = os.path.join(args.out, "data")
    command = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        recipe,
        *overrides,
        "sft.enable=false",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "logging.progress_bar=false",
        "logging.plot=false",
        f"trainer.default_local_dir={folder}",
        f"model.tokenizer_path={data}/tokenizer",
        f"data.train_files=[{data}/train.parquet]",
        f"data.val_files=[{data}/val.parquet]",
        f"data.test_files=[{data}/test.parquet]",
        f"sft.train_files=[{data}/sft.parquet]",
    ]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(folder, "logs", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if r.get("stage") == "rl" and r.get("step", 0) > args.warmup]
    keys = ("time/step_s", "time/sync_reshard_s", "sync/received_bytes", "time/update_s", "time/generate_s")
    return {k: statistics.median(r.get(k, 0.0) for r in steps) for k in keys}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_moe"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):  # interleaved: machine load drifts alike for every variant
        for name in VARIANTS:
            results[name].append(run(name, args, round_index))
    print(f"{args.steps} RL steps per run, medians after {args.warmup}, {args.rounds} rounds [min-max]")
    for name, runs in results.items():
        print(
            f"{name:8s} step {spread([r['time/step_s'] for r in runs])} s, "
            f"update {spread([r['time/update_s'] for r in runs])} s, "
            f"generate {spread([r['time/generate_s'] for r in runs])} s, "
            f"reshard {spread([r['time/sync_reshard_s'] * 1e3 for r in runs])} ms, "
            f"received {spread([r['sync/received_bytes'] / 2**20 for r in runs])} MiB/rank"
        )

    def ratio(a: str, b: str, key: str) -> float:
        return statistics.median(r[key] for r in results[a]) / statistics.median(r[key] for r in results[b])

    print(f"step time EP2 / EP1: {ratio('moe-ep2', 'moe-ep1', 'time/step_s'):.3f}")
    print(f"step time MoE EP2 / dense: {ratio('moe-ep2', 'dense', 'time/step_s'):.3f}")
    print(f"reshard time MoE EP2 / dense: {ratio('moe-ep2', 'dense', 'time/sync_reshard_s'):.3f}")


if __name__ == "__main__":
    main()
