"""Freed host memory kept for reuse on CPU ranks, within a bound, so that a step reuses the previous step's pages.

glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it when
it is freed. A training step on CPU allocates and frees gigabytes of activations, gradients and logits blocks
every step (about 5 GiB at issue 33's realistic shapes), so each step page-faults all of them in again. On the
2-core VMs this project runs on, a page fault costs about 0.4 ms per MiB (filling a fresh 91 MB block: 40 ms,
a reused one: 6 ms), and the training GEMMs that write a fresh output ran 20-35% below the same GEMMs
writing into reused memory (``aten::mm`` per shape inside the realistic update, profiled).

So a CPU rank installs our caching allocator (``csrc/host_cache_cpu.cpp``) as torch's CPU allocator: blocks
of 1 MiB and more are mapped by it and, when freed, kept for the next request within 1/8 of their size, up to
a cap in bytes (the oldest kept blocks are returned first); smaller blocks stay with glibc. That is what
CUDA's caching allocator does for device memory, and Intel's PyTorch CPU tuning guide gets from jemalloc or
tcmalloc with decay off. An earlier policy kept glibc's own heap instead (no mmap, no trim): it reused the
pages as well but had no bound, and first-fit over one heap fragmented at long responses (14.1 GiB resident
at a 10.4 GiB live peak, 8 x 8 x 512 new tokens); exact-size reuse held 11.4 GiB there.

The cap (``trainer.host_cache_gib``; by default a quarter of the memory this process may use, the machine's
or its cgroup's, shared by the ranks on the host) bounds what a rank holds beyond its live tensors; 0 leaves
torch's own CPU allocator in place (a cache installed earlier in the process keeps nothing more and passes
every request to glibc). The cache reports to torch's profiler as torch's allocator does. GPU ranks allocate
device memory through CUDA's caching allocator and are left alone, as is a build without the native extension.
"""

from __future__ import annotations

import platform

from mcore_rl.io.host import host_memory_limit, ranks_on_this_host

MIN_BLOCK_BYTES = 1 << 20
"""Blocks from this size up are the cache's; below it glibc's heap already reuses freed memory."""
CACHE_SHARE = 4
"""The default cap is the process's memory limit over this, over the ranks on the host."""
GIB = 1 << 30


def default_cache_bytes(ranks_on_host: int) -> int:
    """The cap when the run sets none: a quarter of :func:`host_memory_limit` shared by the host's ranks."""
    return host_memory_limit() // CACHE_SHARE // max(1, ranks_on_host)


def _native() -> tuple[object | None, str]:
    from mcore_rl.ops._native import extension_loaded, load_error

    if not extension_loaded():
        return None, f"mcore_rl._C not loaded: {load_error()}"
    from mcore_rl import _C  # type: ignore[attr-defined]

    if not hasattr(_C, "host_cache_configure"):
        return None, "mcore_rl._C predates the host cache: rebuild it (make install)"
    return _C, ""


def keep_freed_host_memory(cache_bytes: int | None = None, ranks_on_host: int = 1, apply: bool = True) -> str:
    """Installs the cache with its cap (``cache_bytes``; None: :func:`default_cache_bytes`) for this process
    and returns one line saying what it did or why not, for the run's log; ``apply=False`` only says what it
    would do here. A second call changes the cap (blocks kept beyond a lower one are returned)."""
    if platform.system() != "Linux":
        return "host memory: left as is (the cache maps memory the Linux way)"
    if cache_bytes is not None and cache_bytes < 0:
        raise ValueError(f"trainer.host_cache_gib: must be at least 0, got {cache_bytes / GIB:g}")
    native, why_not = _native()
    if native is None:
        return f"host memory: left as is ({why_not})"
    chosen = "trainer.host_cache_gib"
    if cache_bytes is None:
        cache_bytes, chosen = (
            default_cache_bytes(ranks_on_host),
            f"1/{CACHE_SHARE} of memory / {ranks_on_host} ranks",
        )
    if apply:
        native.host_cache_configure(cache_bytes, MIN_BLOCK_BYTES)  # type: ignore[attr-defined]
    if cache_bytes == 0:
        return f"host memory: left to glibc ({chosen}=0)"
    return f"host memory: freed blocks of 1 MiB and up kept for reuse, at most {cache_bytes / GIB:.1f} GiB ({chosen})"


def host_cache_stats() -> dict[str, int] | None:
    """The cache's counters (bytes kept, mapped, peak, reuses, maps, bytes returned); None without it."""
    native, _ = _native()
    return None if native is None else dict(native.host_cache_stats())  # type: ignore[attr-defined]


def keep_freed_host_memory_of_run(cache_gib: float | None, world_size: int, apply: bool = True) -> str:
    """:func:`keep_freed_host_memory` for a run's ``trainer.host_cache_gib`` and world size (the worker
    applies it, the driver's fast-path note only describes it)."""
    cache_bytes = None if cache_gib is None else int(cache_gib * GIB)
    return keep_freed_host_memory(cache_bytes, ranks_on_this_host(world_size), apply)
