"""The machine's own speed modes, with nothing of a run changing: one process repeats one fixed decode.

Issue 33 asks a fresh run's step time to be stable within 5%. Our runs on these 2-vCPU VMs fall into two
levels of generation time (tiny workload: 0.081-0.085 s against 0.100-0.108 s per step, whole runs at one
level). This script asks whether a run's state could explain that: a single process builds our embedded
engine once (the tiny model, 8 prompts x 4 samples x 32 new tokens, 2 threads) and times the same
``generate`` call over and over, with no allocation policy, Ray, thread placement or data that changes
between iterations. Beside each iteration it measures the smallest 2-thread parallel region and the same
op on 1 thread (``_measure.parallel_region_us``): if the decode's time moves in steps with the 2-thread
region while the 1-thread op stays put, the host has moved the two vCPUs apart (their meeting costs more),
and no state of ours explains it.

    python -m bench.bench_machine_modes --iterations 400

Prints a compact timeline (decode ms : 2-thread region us : 1-thread us per iteration), then the
iterations split at the middle of the 2-thread region's range, each side's median decode time and its
spread, and the correlation of decode time with each probe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

if __package__:
    from bench._measure import parallel_region_us
    from bench._rollout_models import model_config
    from bench.bench_rollout import Bench, Cell
else:  # python bench/bench_machine_modes.py
    from _measure import parallel_region_us
    from _rollout_models import model_config
    from bench_rollout import Bench, Cell


def timeline(iterations: int, threads: int) -> list[tuple[float, float, float]]:
    """(decode ms, 2-thread region us, 1-thread region us) per iteration; decode is the median of 3 calls."""
    torch.set_num_threads(threads)
    bench = Bench(model_config("tiny"), 16, ("ours",))
    cell = Cell(8, 4, 32, threads)
    bench.prepare(cell)
    generate = bench._runners(cell)["ours"]
    generate()  # warm-up: the decoder's buffers and the kernels' first touch
    rows = []
    for _ in range(iterations):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            generate()
            times.append(time.perf_counter() - start)
        rows.append(
            (statistics.median(times) * 1e3, parallel_region_us(threads, 500), parallel_region_us(1, 500))
        )
    return rows


def report(rows: list[tuple[float, float, float]]) -> None:
    decode, region, single = (list(col) for col in zip(*rows, strict=True))
    print(" ".join(f"{d:.1f}:{r:.2f}:{s:.2f}" for d, r, s in rows))
    middle = (min(region) + max(region)) / 2
    for name, keep in (("near (2-thread region below the middle)", True), ("apart", False)):
        side = [d for d, r in zip(decode, region, strict=True) if (r < middle) == keep]
        if side:
            print(
                f"{name}: {len(side)} iterations, decode median {statistics.median(side):.1f} ms "
                f"(spread {max(side) / min(side) - 1:.1%}), 2-thread region median "
                f"{statistics.median(r for r in region if (r < middle) == keep):.2f} us"
            )
    print(
        f"all: decode {min(decode):.1f}-{max(decode):.1f} ms (spread {max(decode) / min(decode) - 1:.1%}); "
        f"correlation of decode with the 2-thread region {statistics.correlation(decode, region):+.2f}, with the "
        f"1-thread op {statistics.correlation(decode, single):+.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error(f"--iterations={args.iterations}: at least 2 are needed for a spread")
    start = time.strftime("%Y-%m-%d %H:%M:%S")
    report(timeline(args.iterations, args.threads))
    print(f"measured {start} - {time.strftime('%H:%M:%S')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
