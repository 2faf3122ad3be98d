"""A CPU rank keeps freed blocks in its heap (``engine/workers/host_heap.py``): a second step's allocation of
the same size reuses the pages instead of faulting them in again; a user's glibc setting wins. Each case runs
in a fresh interpreter, since the policy is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, resource
import torch
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory

note = keep_freed_host_memory()
torch.manual_seed(0)
layer = torch.nn.Linear(256, 4096)
batch = torch.randn(4096, 256)
faults = []
for step in range(8):  # a training step's pattern: 64 MiB activations and their gradients, freed each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.relu(layer(batch)).square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"note": note, "faults": faults}))
"""


def _child(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_repeated_step_reuses_its_pages_unless_the_user_set_glibcs_own() -> None:
    kept, left = _child({}), _child({"MALLOC_MMAP_MAX_": "65536"})
    assert kept["note"] == "host heap: freed blocks kept for reuse (no mmap, no trim)", kept["note"]
    assert left["note"] == "host heap: left as is (MALLOC_MMAP_MAX_ set)", left["note"]
    one_step = min(left["faults"][-5:])  # glibc's default: every step faults its blocks in again
    assert one_step > 100_000, left  # 4096 x 4096 fp32 blocks, 4 KiB pages
    # kept: the last five steps together fault in less than half of one step (an odd block may land anew)
    assert sum(kept["faults"][-5:]) < one_step // 2, (kept, left)
