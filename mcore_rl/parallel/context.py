"""ParallelContext: the one place that initialises torch.distributed and megatron-core's parallel_state.

Everything of ours that needs a process group takes a ``ParallelContext`` argument; nothing reads
megatron's ``parallel_state`` globals directly. megatron-core itself still keeps those globals, so at most
one context is active per process: building a second while one is live is an error, and
:meth:`ParallelContext.destroy` releases megatron's state so a new layout can be built in the same world
(the test pool does this between tests).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from mcore_rl.compat import gloo_device
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.failure import FailureGuard
from mcore_rl.parallel.host_reduce import HostReduce
from mcore_rl.parallel.launch_env import free_local_port, prepare_launch_env, rendezvous_for_init
from mcore_rl.parallel.layout import LayoutError, ParallelLayout


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _init_world(backend: str, timeout_minutes: int) -> None:
    """Join the launcher's world (env:// rendezvous) unless this process already has one."""
    gloo_device.apply()  # megatron's two dozen groups on one transport loop, not one each
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise LayoutError(
                f"process group uses backend {dist.get_backend()!r}, config asks for {backend!r}"
            )
        return
    with rendezvous_for_init():  # a made-up world of one leaves nothing behind for the next world
        prepare_launch_env()  # stale launcher variables of a single process: ignored, never waited on
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing and os.environ.get("WORLD_SIZE", "1") == "1":
            # A plain `python script.py`: a world of one on a free local port.
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_local_port()))
        elif missing:
            raise LayoutError(
                f"torch.distributed rendezvous variables missing: {missing} (launch with torchrun)"
            )
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def _live_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of, the default one excluded."""
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_group() if dist.is_initialized() else None
    return [g for g in distributed_c10d._world.pg_map if g is not default]


SMALL_REDUCE_SLOT_BYTES = 4096
"""Per rank, for :meth:`ParallelContext.all_reduce`'s counts, loss terms and flags (larger ones go in pieces)."""


class ParallelContext:
    """The process groups and coordinates of this rank, built once and passed explicitly.

    Build with :meth:`initialize`; ``__init__`` only stores.
    """

    _active: ClassVar[ParallelContext | None] = None
    _num_built: ClassVar[int] = 0
    """Contexts built in this process; all ranks build them in step, so it names one context world-wide."""

    def __init__(
        self,
        config: ParallelConfig,
        layout: ParallelLayout,
        rank: int,
        device: torch.device,
        seed: int = 1234,
    ) -> None:
        self.config = config
        self.seed = seed
        """The base seed megatron's data-parallel and per-TP-rank RNG streams derive from."""
        self.layout = layout
        self.rank = rank
        self.device = device
        self.coords = layout.coords(rank)
        self.expert_coords = layout.expert_coords(rank)
        """This rank's place in the experts' mesh (etp, ep, edp, pp); see ``parallel/layout.py``."""
        self._live = True
        self._subgroups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}
        self._megatron_groups: list[dist.ProcessGroup] = []
        self._host_reducers: dict[int | None, HostReduce | None] = {}
        """:meth:`all_reduce`'s shared-memory reducer per group (None: the group keeps gloo or NCCL)."""
        self.failures: FailureGuard | None = None
        """Failure propagation among this context's ranks (see :meth:`guard`); set by :meth:`initialize`."""

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def initialize(cls, config: ParallelConfig | None = None, seed: int = 1234) -> ParallelContext:
        """Join (or create) the torch.distributed world, then build megatron's groups for ``config``."""
        config = config or ParallelConfig()
        if cls._active is not None:
            raise RuntimeError("a ParallelContext is already active in this process; destroy() it first")
        backend = config.backend or _default_backend()
        if backend == "gloo" and not torch.cuda.is_available():
            from mcore_rl.compat import megatron_cpu

            megatron_cpu.apply()
        _init_world(backend, config.timeout_minutes)
        layout = config.layout(dist.get_world_size())

        from megatron.core import parallel_state, tensor_parallel

        groups_before = _live_process_groups()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
            distributed_timeout_minutes=config.timeout_minutes,
            create_gloo_process_groups=backend == "gloo",
        )
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        ctx = cls(config, layout, dist.get_rank(), device, seed)
        # megatron's destroy_model_parallel only forgets its groups; we destroy them, or every rebuilt
        # context would leak a few dozen communicators (and their threads) into the process.
        ctx._megatron_groups = [g for g in _live_process_groups() if g not in groups_before]
        cls._num_built += 1
        store = distributed_c10d._get_default_store()
        ctx.failures = FailureGuard(store, f"mcore_rl/failure/{cls._num_built}", ctx.rank)
        cls._active = ctx
        return ctx

    def destroy(self, destroy_process_group: bool = False) -> None:
        """Release megatron's groups; with ``destroy_process_group`` also leave the torch.distributed world."""
        if not self._live:
            return
        from megatron.core import parallel_state

        if self.failures is not None:
            self.failures.close()
        for reducer in self._host_reducers.values():
            if reducer is not None:
                reducer.close()
        self._host_reducers.clear()
        parallel_state.destroy_model_parallel()
        for group in {id(g): g for g in [*self._subgroups.values(), *self._megatron_groups]}.values():
            if group in _live_process_groups():  # some are aliases of one communicator
                dist.destroy_process_group(group)
        self._subgroups.clear()
        self._megatron_groups.clear()
        self._live = False
        if ParallelContext._active is self:
            ParallelContext._active = None
        if destroy_process_group and dist.is_initialized():
            dist.destroy_process_group()

    @classmethod
    def release_active(cls) -> None:
        """Destroy whatever context is live (test teardown after a failure); keeps the world."""
        if cls._active is not None:
            cls._active.destroy()

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    # --- groups and coordinates -----------------------------------------------------------------------------
    @property
    def _ps(self) -> Any:
        if not self._live:
            raise RuntimeError("this ParallelContext was destroyed")
        from megatron.core import parallel_state

        return parallel_state

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks splitting this rank's sequences (context parallelism), in CP-rank order."""
        return self._ps.get_context_parallel_group()

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """Every rank holding this rank's weight shard: DP x CP (where DDP reduces gradients)."""
        return self._ps.get_data_parallel_group(with_context_parallel=True)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._ps.get_tensor_model_parallel_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._ps.get_pipeline_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._ps.get_data_parallel_group()

    @property
    def model_parallel_group(self) -> dist.ProcessGroup:
        return self._ps.get_model_parallel_group()

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.expert_coords.ep

    @property
    def expert_tp_size(self) -> int:
        return self.layout.expert_tp

    @property
    def expert_tp_rank(self) -> int:
        return self.expert_coords.etp

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self._ps.get_expert_model_parallel_group()

    @property
    def expert_tp_group(self) -> dist.ProcessGroup:
        return self._ps.get_expert_tensor_parallel_group()

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        return self._ps.get_expert_data_parallel_group()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def holds_first_layers(self, chunk: int | None = None) -> bool:
        """Whether model chunk ``chunk`` (its virtual stage; None without interleaving) on this rank starts the
        model (the embedding lives there): megatron's ``is_pipeline_first_stage(vp_stage=chunk)``."""
        return self.pp_rank == 0 and (chunk is None or chunk == 0)

    def holds_last_layers(self, chunk: int | None = None) -> bool:
        """Whether model chunk ``chunk`` on this rank ends the model (the output layer and loss live there):
        megatron's ``is_pipeline_last_stage(vp_stage=chunk)``."""
        last_chunk = (self.layout.vpp or 1) - 1
        return self.is_last_stage and (chunk is None or chunk == last_chunk)

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length must be a multiple of: ``2 x CP`` under context parallelism (each CP rank
        holds two of ``2 x CP`` equal chunks), times the TP size under sequence parallelism (each TP rank holds
        an equal slice of the rank's tokens); 1 without either."""
        return self.layout.sequence_multiple

    def subgroup(self, groups: list[list[int]]) -> dist.ProcessGroup:
        """This rank's group within ``groups``, a partition of the world (e.g. the rollout TP groups).

        Every rank must call it with the same partition (torch creates every group on every rank); the groups
        are created once per partition and destroyed with the context. Each group's order is kept: a rank's
        position in its group is its group rank (the rollout TP coordinate for ``ReshardPlan.rollout_groups``,
        which need not follow rank order; torch would sort it by default).
        """
        key = tuple(tuple(g) for g in groups)
        if sorted(r for g in key for r in g) != list(range(self.world_size)):
            raise ValueError(f"groups {groups} do not partition the {self.world_size} ranks")
        if key not in self._subgroups:
            handles = [
                dist.new_group(list(g), sort_ranks=False) for g in key
            ]  # collective: same on every rank
            self._subgroups[key] = next(h for g, h in zip(key, handles, strict=True) if self.rank in g)
        return self._subgroups[key]

    @property
    def collective_timeout_s(self) -> float:
        """How long a collective waits for a peer (``parallel.timeout_minutes``), gloo's and the host reducers'."""
        return 60.0 * self.config.timeout_minutes

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: str = "sum"
    ) -> None:
        """In place over ``group`` (the world when None), ``op`` "sum" or "max": for the step's small
        collectives (token counts, loss terms, the finite flag). On CPU ranks of one host these go through a
        shared mapping (:class:`~mcore_rl.parallel.host_reduce.HostReduce`, opened for the group at its first
        call here, collectively, as the all-reduce itself is). Six floats between two single-threaded ranks on
        this project's 2-vCPU VMs, 400 calls each way: gloo's TCP loopback 0.25 ms median and 3.8 ms at the
        90th percentile, through the mapping 0.05 and 0.2 ms. Elsewhere torch.distributed's."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce: op {op!r} is not 'sum' or 'max'")
        reducer = self._host_reducer(group)
        if reducer is None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
            return
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        reducer.all_reduce_(flat, op=op)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def _host_reducer(self, group: dist.ProcessGroup | None) -> HostReduce | None:
        key = None if group is None else id(group)
        if key not in self._host_reducers:
            shared = self.device.type == "cpu" and dist.get_backend(group) == "gloo"
            self._host_reducers[key] = (
                HostReduce.open(group, SMALL_REDUCE_SLOT_BYTES, self.collective_timeout_s) if shared else None
            )
        return self._host_reducers[key]

    def guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A region whose failure on this rank stops every peer within seconds, their errors
        (:class:`~mcore_rl.parallel.failure.PeerFailureError`) naming this rank and its exception; see
        :mod:`mcore_rl.parallel.failure`. ``what`` names the region in those errors."""
        return self.failures.guard(what) if self.failures is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"ParallelContext(rank={self.rank}/{self.world_size}, tp={c.tp}/{self.tp_size}, "
            f"pp={c.pp}/{self.pp_size}, dp={c.dp}/{self.dp_size}, vpp={self.layout.vpp}, sp={self.layout.sp}"
            + (f", cp={c.cp}/{self.cp_size}" if self.cp_size > 1 else "")
            + (
                f", ep={self.ep_rank}/{self.ep_size}, etp={self.expert_tp_rank}/{self.expert_tp_size})"
                if self.ep_size > 1 or self.expert_tp_size != self.tp_size
                else ")"
            )
        )
