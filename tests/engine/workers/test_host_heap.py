"""A CPU rank keeps freed tensor memory for reuse within a cap (``engine/workers/host_heap.py``, the caching
allocator in ``csrc/host_cache_cpu.cpp``): a second step's blocks reuse the first step's pages instead of
faulting them in again, what is kept never exceeds the cap, a block serves only requests within 1/8 of its
size, and the numbers a step computes do not change. Each case runs in a fresh interpreter, since the
allocator is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_rl.config import RunConfig, check_config
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory
from mcore_rl.io.errors import ConfigError
from mcore_rl.ops._native import extension_loaded

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cache maps memory the Linux way"),
    pytest.mark.skipif(not extension_loaded(), reason="the cache is in mcore_rl._C"),
]
MIB = 1 << 20

STEPS = """
import json, resource, sys
import torch
from mcore_rl.engine.workers.host_heap import host_cache_stats, keep_freed_host_memory

cap = None if sys.argv[1] == "default" else int(sys.argv[1])
note = keep_freed_host_memory(cap)
torch.manual_seed(0)
layer = torch.nn.Linear(256, 4096)
batch = torch.randn(4096, 256)
faults, losses = [], []
for step in range(8):  # a training step's pattern: 64 MiB activations and their gradients, freed each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    loss = torch.relu(layer(batch)).square().mean()
    loss.backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    losses.append(loss.item())
print(json.dumps({"note": note, "faults": faults, "losses": losses, "grad": layer.weight.grad.sum().item(),
                  "stats": host_cache_stats()}))
"""


def _child(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_repeated_step_reuses_its_pages_and_computes_the_same() -> None:
    kept, returned = _child(STEPS, "default"), _child(STEPS, "0")
    assert kept["note"].startswith("host memory: freed blocks of 1 MiB and up kept for reuse, at most "), kept
    assert returned["note"] == "host memory: left to glibc (trainer.host_cache_gib=0)"
    one_step = min(returned["faults"][-5:])  # glibc maps blocks above 32 MiB anew: every step faults them in
    assert one_step > 100_000, returned  # 4096 x 4096 fp32 blocks, 4 KiB pages
    # kept: the last five steps together fault in less than a tenth of one step
    assert sum(kept["faults"][-5:]) < one_step // 10, (kept, returned)
    assert kept["stats"]["reused"] > 0 and returned["stats"]["reused"] == 0
    # a zero cap leaves torch's own CPU allocator in place, not ours passing every block through
    assert kept["stats"]["installed"] and not returned["stats"]["installed"]
    assert kept["losses"] == returned["losses"] and kept["grad"] == returned["grad"]  # bit for bit


BOUND = """
import json
import torch
from mcore_rl.engine.workers.host_heap import host_cache_stats, keep_freed_host_memory

MIB = 1 << 20
keep_freed_host_memory(64 * MIB)
seen = []
blocks = [torch.ones(mib * MIB // 4) for mib in (4, 8, 12, 16, 20, 24, 28, 32)]  # 144 MiB, all distinct sizes
while blocks:  # freed smallest first: the cap keeps the last freed that fit in 64 MiB (32 and 28)
    blocks.pop(0)
seen.append(host_cache_stats())
fit = torch.empty(30 * MIB // 4)  # the 32 MiB block serves it (within 1/8); 16 MiB would not serve 20
seen.append(host_cache_stats())
small = torch.empty(20 * MIB // 4)
seen.append(host_cache_stats())
keep_freed_host_memory(8 * MIB)  # a lower cap returns what is kept beyond it
seen.append(host_cache_stats())
print(json.dumps(seen))
"""


def test_what_is_kept_stays_within_the_cap_and_serves_only_near_sizes() -> None:
    freed, took, missed, lowered = _child(BOUND)
    assert freed["max_cached_bytes"] == 64 * MIB
    # 32 + 28 MiB fit under 64 MiB (each block rounds up by one page for its header)
    assert freed["cached_bytes"] <= 64 * MIB and freed["cached_bytes"] > 56 * MIB, freed
    assert freed["returned_bytes"] > 80 * MIB, freed
    assert took["reused"] == freed["reused"] + 1 and took["mapped"] == freed["mapped"], took
    # 20 MiB: the kept 28 MiB block is more than 1/8 too large, so a new block is mapped
    assert missed["reused"] == took["reused"] and missed["mapped"] == took["mapped"] + 1, missed
    assert lowered["cached_bytes"] <= 8 * MIB, lowered


def test_a_negative_cap_is_named_at_the_boundary() -> None:
    cfg = RunConfig()
    cfg.trainer.host_cache_gib = -1.0
    with pytest.raises(ConfigError, match=r"trainer\.host_cache_gib"):
        check_config(cfg)
    with pytest.raises(ValueError, match=r"trainer\.host_cache_gib"):
        keep_freed_host_memory(-1)


PROFILED = """
import json
import torch
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory

keep_freed_host_memory(64 << 20)
seen = []
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
    for _ in range(2):  # the second block is the first one reused from the cache
        block = torch.ones(4 << 18)  # 4 MiB: one of the cache's blocks
        del block
seen = [e.cpu_memory_usage for e in prof.key_averages() if e.key == "aten::empty"]
print(json.dumps({"empty": seen}))
"""


def test_the_profilers_memory_view_sees_the_caches_blocks() -> None:
    """Profiling with ``profile_memory=True`` reports our blocks as it reports torch's own allocator's."""
    seen = _child(PROFILED)
    assert seen["empty"] == [2 * 4 * MIB], seen


RETURNED_BETWEEN_SIDES = """
import json
import torch
from bench.bench_grpo_step import _returning_host_cache
from mcore_rl.engine.workers.host_heap import host_cache_stats

during = {}
def step(prompts, seed):
    block = torch.ones(16 << 18)  # 16 MiB, freed within the step: the cache keeps it
    del block
    during.update(host_cache_stats())
    return {"step": float(seed)}
out = _returning_host_cache(step)(None, 3)
print(json.dumps({"out": out, "during": during, "after": host_cache_stats()}))
"""


def test_the_scaling_bench_keeps_the_cache_within_our_step_and_empties_it_after() -> None:
    """``bench_grpo_step --return-host-cache``: TRL's process runs while ours holds nothing it kept."""
    seen = _child(RETURNED_BETWEEN_SIDES)
    assert seen["out"] == {"step": 3.0}
    assert seen["during"]["max_cached_bytes"] > 0 and seen["during"]["cached_bytes"] >= 16 * MIB, seen
    assert seen["after"]["cached_bytes"] == 0 and seen["after"]["max_cached_bytes"] == 0, seen
    assert seen["after"]["returned_bytes"] >= 16 * MIB, seen


SIDES_IN_TURN = """
import argparse, json
import torch
import bench.bench_grpo_step as bench
from mcore_rl.engine.workers.host_heap import host_cache_stats, keep_freed_host_memory

keep_freed_host_memory()
order, kept = [], {}
class Ours:
    def step(self, prompts, seed):
        block = torch.ones(16 << 18)  # 16 MiB, freed within the step: the cache keeps it
        del block
        kept[f"ours {seed}"] = host_cache_stats()["cached_bytes"]
        order.append(f"ours {seed}")
        return {"step": 1.0}
class Gemm:
    def step(self, prompts, seed):
        order.append(f"gemm {seed}")
        return {"step": 0.0}
def baseline_sides(args, prompts, labels, stack):
    kept["baseline built"] = host_cache_stats()["cached_bytes"]
    order.append("baseline built")
    return {"trl": lambda prompts, seed: order.append(f"trl {seed}") or {"step": 2.0}}
bench._baseline_sides = baseline_sides
args = argparse.Namespace(return_host_cache=False, no_always=True, sides_in_turn=True, rounds=2)
rows = bench._measure(args, Ours(), Gemm(), None, {})
print(json.dumps({"order": order, "kept": kept, "sides": sorted(rows), "trl": rows["trl"]}))
"""


def test_sides_in_turn_keeps_our_cache_through_our_steps_and_returns_it_before_the_baseline() -> None:
    """``bench_grpo_step --sides-in-turn`` (the scaling sweep): our warm-up and rounds back to back with what
    the cache kept still there (as in a run), then the cache emptied, and only then the baseline built."""
    seen = _child(SIDES_IN_TURN)
    assert seen["order"] == [
        "ours 0",
        "ours 1",
        "ours 2",
        "gemm 1",
        "gemm 2",
        "baseline built",
        "trl 0",
        "trl 1",
        "trl 2",
    ]
    assert all(seen["kept"][f"ours {seed}"] >= 16 * MIB for seed in range(3)), seen
    assert seen["kept"]["baseline built"] == 0, seen
    assert seen["sides"] == ["gemm", "ours", "trl"] and seen["trl"] == [{"step": 2.0}] * 2
