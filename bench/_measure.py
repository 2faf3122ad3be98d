"""Timing and peak-memory helpers shared by the op benchmarks.

Peak memory on CPU: tracemalloc does not see torch's allocations and torch has no CPU peak counter, so we
use the kernel's own high-water mark of resident memory. Each variant runs in a fresh subprocess; after the
inputs are built and one warm-up iteration has run (and been freed), the child resets the high-water mark
(``echo 5 > /proc/self/clear_refs``), runs one iteration and reports ``VmHWM - VmRSS before``: the most
memory the iteration ever held on top of its inputs. glibc serves large tensors with mmap and unmaps them
on free only above its mmap threshold, which it raises on the fly (up to 32 MiB) and would then serve
medium tensors from a heap it keeps; ``MALLOC_MMAP_THRESHOLD_`` pins the threshold at 128 KiB in the
measuring processes, so every tensor of any size is mapped when allocated and unmapped when freed, and the
figure is the true peak of live tensors (to the page), plus a few MB of allocator and thread noise.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from /proc/self/status (Linux only)")


def peak_extra_bytes(run: Callable[[], object]) -> int:
    """Peak resident memory ``run()`` adds on top of what the process holds now (call in a fresh process)."""
    baseline = _status_bytes("VmRSS")
    reset_peak_rss()
    run()
    return _status_bytes("VmHWM") - baseline


# Set in the environment of every process that measures memory (see the module docstring).
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def child_peak(script: str, args: Sequence[str]) -> dict:
    """Runs ``script --child ARGS`` in a fresh interpreter and returns the JSON it prints last."""
    env = {**os.environ, **MEASURE_ENV}
    cmd = [sys.executable, script, "--child", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_seconds(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time of each callable, interleaved (a, b, a, b, ...) so that load from other processes on
    a shared machine hits every variant alike. One untimed warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def mib(n: float) -> str:
    return f"{n / 2**20:9.1f} MiB"


def reset_peak_rss() -> None:
    """Resets this process's resident high-water mark (VmHWM) to its current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The most memory this process held resident since the last :func:`reset_peak_rss` (or its start)."""
    return _status_bytes("VmHWM")


def mm_seconds(rows: int, inner: int, cols: int, reps: int = 3) -> float:
    """Median wall time of the faster fp32 GEMM of this machine on a ``[rows, inner]`` by ``[inner, cols]``
    product: ATen's ``torch.mm`` (MKL) or oneDNN's (``mcore_rl::gemm``, where the extension is built; on AMD
    CPUs with AVX-512 it runs AVX-512 where MKL runs AVX2), each timed and the faster kept, so a limit made
    of it is the machine's, not one library's. One untimed call each first (the operands' first touch and
    the library's per-shape set-up). The operands live only here, so that timing a large set of shapes never
    holds them all at once."""
    import torch

    from mcore_rl.ops import gemm

    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    products = [torch.mm]
    if gemm.onednn_available():
        products.append(partial(torch.ops.mcore_rl.gemm, add=None))
    best = float("inf")
    for product in products:
        product(a, b)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            product(a, b)
            times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times))
    return best


def memcpy_bytes_per_s(num_bytes: int, reps: int = 5) -> float:
    """This machine's copy bandwidth at ``num_bytes``: bytes copied per second by ``Tensor.copy_`` between
    two touched buffers of that size, best of ``reps`` (each byte is read once and written once)."""
    import torch

    source = torch.ones(max(num_bytes, 1), dtype=torch.uint8)
    target = torch.zeros_like(source)
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.numel() / best


def machine_cpu_jiffies(stat_path: str = "/proc/stat") -> tuple[int, int]:
    """This machine's CPU time so far (a VM's: its vCPUs') as ``(all, stolen)`` clock ticks, from
    ``/proc/stat``'s first line: stolen is the time the hypervisor ran something else while the vCPUs wanted
    to run (zero on bare metal).
    Two readings give the share of a span's CPU time a VM lost to its host; (0, 0) where the file is
    missing."""
    try:
        with open(stat_path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    # user nice system idle iowait irq softirq steal (guest times are already inside user and nice)
    return sum(fields[:8]), (fields[7] if len(fields) > 7 else 0)


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of this machine's CPU time between two :func:`machine_cpu_jiffies` readings that was stolen."""
    total = after[0] - before[0]
    return (after[1] - before[1]) / total if total > 0 else 0.0


def parallel_region_us(threads: int, reps: int = 2000) -> float:
    """Microseconds per smallest parallel region at ``threads`` threads: an add over 64 Ki floats (two of
    at::parallel_for's 32 Ki grains, so two threads split it), best of three rounds of ``reps``. At 2 threads
    it is mostly the cost of the threads meeting: on these VMs it moves with how far apart the host runs the
    two vCPUs (about 4.2 us against 5.7 us), while the same add on 1 thread does not move; decode, made of
    many small parallel regions per token, slows with it (bench/bench_machine_modes.py)."""
    import torch

    before = torch.get_num_threads()
    x = torch.ones(1 << 16)
    out = torch.empty_like(x)
    torch.set_num_threads(threads)
    try:
        rounds = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                torch.add(x, 1.0, out=out)
            rounds.append((time.perf_counter() - start) / reps * 1e6)
    finally:
        torch.set_num_threads(before)
    return min(rounds)
