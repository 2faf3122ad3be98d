"""Freed host memory kept in the process heap on CPU ranks, so that a step reuses the previous step's pages.

glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it when
it is freed. A training step on CPU allocates and frees gigabytes of activations, gradients and logits blocks
every step (about 5 GiB at issue 33's realistic shapes), so each step page-faults all of them in again. On the
2-core VMs this project runs on, a page fault costs about 0.4 ms per MiB (filling a fresh 91 MB block: 40 ms,
a reused one: 6 ms), and the training GEMMs that write a fresh output ran 20-35% below the same GEMMs
writing into reused memory (``aten::mm`` per shape inside the realistic update, profiled).

With ``mmap`` off for large blocks (``M_MMAP_MAX=0``) and the heap never trimmed (``M_TRIM_THRESHOLD=-1``),
freed blocks stay in the heap and the next step's allocations of the same sizes find them: the policy
Intel's PyTorch CPU tuning guide sets through jemalloc or tcmalloc with decay off, here with the allocator
the process already has. The cost is that a rank's resident set stays at its peak between phases. GPU ranks
allocate device memory through CUDA's caching allocator and are left alone. A user who wants freed memory
returned sets glibc's own variables (``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_`` or a
``glibc.malloc`` tunable); this then changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
"""``mallopt`` parameter (malloc.h): free memory at the heap's top above this is returned to the system."""
M_MMAP_MAX = -4
"""``mallopt`` parameter (malloc.h): how many blocks may be served by ``mmap`` at once; 0 turns it off."""
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
"""glibc's environment variables for the same knobs: a user who set one has chosen, and is not overridden."""


def keep_freed_host_memory(apply: bool = True) -> str:
    """Sets the policy above for this process (glibc on Linux only) and returns one line saying what it did
    or why not, for the run's log; ``apply=False`` only says what it would do here."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "host heap: left as is (not glibc)"
    chosen = [name for name in USER_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"host heap: left as is ({', '.join(chosen)} set)"
    if not apply:
        return "host heap: freed blocks kept for reuse on CPU ranks (no mmap, no trim)"
    libc = ctypes.CDLL(None)  # the running process's C library, already loaded
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, -1) != 1:
        return "host heap: left as is (mallopt refused)"
    return "host heap: freed blocks kept for reuse (no mmap, no trim)"
