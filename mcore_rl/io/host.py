"""What this host grants the job: its CPUs and its memory (Slurm and cgroup limits first). Read by the run
config's machine defaults (``config/machine.py``), the controller's local Ray and the ranks' host cache. And
whether a process of this host still exists (a staging folder's writer, a rank the controller ends), and who
made its CPU (which GEMM and decode kernels run fastest depends on it)."""

from __future__ import annotations

import functools
import os


def available_cpus(environ: dict[str, str] | None = None) -> int:
    """CPUs granted to this job: ``SLURM_CPUS_ON_NODE``, else ``len(os.sched_getaffinity(0))``."""
    env = os.environ if environ is None else environ
    slurm = env.get("SLURM_CPUS_ON_NODE")
    if slurm:
        try:
            value = int(slurm)
        except ValueError:
            raise ValueError(f"SLURM_CPUS_ON_NODE must be an integer, got {slurm!r}") from None
        if value < 1:
            raise ValueError(f"SLURM_CPUS_ON_NODE must be >= 1, got {value}")
        return value
    return len(os.sched_getaffinity(0))


def host_memory_limit() -> int:
    """Bytes this process may use: the machine's memory, or its cgroup's limit (v2 or v1) when lower."""
    with open("/proc/meminfo") as f:
        limit = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            limit = min(limit, int(value))
    return limit


def ranks_on_this_host(world_size: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` where set, else the whole world (CPU runs share one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``); empty where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""
