"""Ray's side of placement: starting or joining Ray, and resource pools on placement groups.

``num_cpus`` for a local Ray comes from the environment, never from a guess: Slurm's allocation
(``SLURM_CPUS_ON_NODE``) when present, else the CPUs this process may run on (``os.sched_getaffinity``),
which honours cgroup/taskset limits that ``os.cpu_count()`` ignores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mcore_rl.controller.tensor_transport import register_tensor_transport
from mcore_rl.io.host import available_cpus
from mcore_rl.io.signals import HANDLED_SIGNALS, STOP_SIGNALS, reclaim_handlers


@dataclass(frozen=True)
class RayConfig:
    """How the driver reaches Ray."""

    address: str | None = None
    """``None`` starts a local Ray inside the driver; ``'auto'`` or ``'host:port'`` joins a running cluster
    (``ray start --head`` / the Slurm template)."""
    num_cpus: int | None = None
    """Logical CPUs of a local Ray; None: :func:`available_cpus`. Ignored when joining a cluster."""
    object_store_memory_bytes: int = 256 << 20
    """Object store size of a local Ray (bulk tensors pass through it once per shard)."""
    worker_niceness: int = 0
    """Unix niceness of a local Ray's worker processes. Ray's default, 15, keeps its own daemons ahead of
    the workers; but our workers are the training ranks, and at 15 they get a small share of any CPU that
    other processes also want (measured: the demo's step 1.26-2.1x slower through Ray than in-process on a
    loaded 2-core machine, 1.06x at 0). A cluster joined by address keeps its own setting
    (``RAY_worker_niceness=0 ray start ...``)."""


def init_ray(config: RayConfig | None = None) -> bool:
    """Start or join Ray unless already connected; True when this call started or joined it (the caller
    then owns ``ray.shutdown()``)."""
    import ray

    config = config or RayConfig()
    started = not ray.is_initialized()
    # Ray's core worker installs native handlers of its own (on SIGTERM: a stack dump and exit 15); the
    # driver's handlers (an interrupt that cleans up, a stop that saves a checkpoint first) are put back.
    ours = {s: signal.getsignal(s) for s in (*HANDLED_SIGNALS, *STOP_SIGNALS)}
    # Ray's own INFO lines ("Started a local Ray instance") only with mcore-rl --verbose
    quiet = os.environ.get("MCORE_RL_VERBOSE", "") in ("", "0")
    level = logging.WARNING if quiet else logging.INFO
    if quiet:
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            _SECURE_DEFAULT_NOTE
        )
        # A failed call is reported once, by its root cause (worker_group.WorkerGroup.get); the other ranks'
        # results, abandoned then, hold that failure's consequences (a peer's connection reset), which Ray
        # would print with a traceback each when they are dropped.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if started and config.address is not None:
        ray.init(address=config.address, include_dashboard=False, log_to_driver=True, logging_level=level)
    elif started:
        ray.init(
            num_cpus=config.num_cpus or available_cpus(),
            include_dashboard=False,
            logging_level=level,
            object_store_memory=config.object_store_memory_bytes,
            log_to_driver=True,
            _system_config={
                "worker_niceness": config.worker_niceness,
                # Ray prestarts one worker process per CPU; those no actor takes stay idle, and each wakes
                # ~140 times a second (its task loop's 10 ms signal check, gRPC pollers): on a small machine
                # that preempts the training ranks. With a soft limit of 0 the raylet ends idle workers
                # after ``idle_worker_killing_time_threshold_ms`` (1 s); actors are never idle.
                "num_workers_soft_limit": 0,
            },
        )
    reclaim_handlers(ours)
    register_tensor_transport()
    return started


class _SecureDefaultNote(logging.Filter):
    """Drops Ray's notice that its local cluster uses token authentication (the secure default: nothing to
    act on, and one more line above the progress bar); its warning that authentication is *off* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled" not in record.getMessage()


_SECURE_DEFAULT_NOTE = _SecureDefaultNote()  # one instance: logging adds a filter once, however many inits


def cluster_cpus() -> float:
    """CPUs of the Ray cluster this process is connected to."""
    import ray

    return float(ray.cluster_resources().get("CPU", 1.0))


@contextlib.contextmanager
def ray_shut_down_on_failure(started: bool) -> Iterator[None]:
    """Around a run's start-up: a failure stops the local Ray this process started for it (``started``), so
    nothing of a failed run outlives it; Ray joined at an address is left running."""
    try:
        yield
    except BaseException:
        if started:
            import ray

            ray.shutdown()
        raise


def shutdown_ray() -> None:
    import ray

    ray.shutdown()


class ResourcePool:
    """One placement group of ``num_bundles`` equal bundles; each worker rank takes one bundle.

    Roles colocated in the same processes (actor, reference, rollout: the hybrid worker) share one pool,
    which is the default. A separate pool (e.g. for a reward model) is simply another ``ResourcePool``.
    """

    def __init__(
        self,
        num_bundles: int,
        cpus_per_bundle: float,
        gpus_per_bundle: float = 0.0,
        strategy: str = "PACK",
        ready_timeout_s: float = 60.0,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if num_bundles < 1:
            raise ValueError(f"num_bundles must be >= 1, got {num_bundles}")
        if cpus_per_bundle <= 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
        self.num_bundles = num_bundles
        self.cpus_per_bundle = cpus_per_bundle
        self.gpus_per_bundle = gpus_per_bundle
        bundle: dict[str, float] = {"CPU": cpus_per_bundle}
        if gpus_per_bundle:
            bundle["GPU"] = gpus_per_bundle
        self.placement_group = placement_group([bundle] * num_bundles, strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=ready_timeout_s)
        if not ready:
            self.remove()
            raise RuntimeError(
                f"placement group of {num_bundles} x {bundle} not ready after {ready_timeout_s:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}"
            )

    @classmethod
    def for_world(cls, world_size: int, use_gpus: bool = False) -> ResourcePool:
        """Bundles for ``world_size`` ranks sharing this cluster's CPUs evenly (one GPU each with GPUs)."""
        import ray

        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        return cls(world_size, cpus / world_size, 1.0 if use_gpus else 0.0)

    def scheduling(self, bundle_index: int) -> Any:
        """The Ray scheduling strategy that pins an actor to bundle ``bundle_index``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=bundle_index
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)
