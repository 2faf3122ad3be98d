"""One gloo transport device per process, shared by every gloo process group of that process.

torch builds each gloo group a transport device of its own, and a gloo TCP device runs a loop thread that
wakes every 10 ms (the timeout of its ``epoll_wait``) whether or not its group is in use. megatron builds
about two dozen groups per rank (its gloo copies of the data-parallel groups included), so each rank of a
two-rank CPU run carried 24 such threads: 2,400 wake-ups a second per rank (measured from ``/proc``: 99 a
second per thread), each one taking the vCPU from that rank's compute thread on a machine with one vCPU per
rank (its main thread was switched out involuntarily ~600 times a second). A gloo device serves any number of
groups (each group's pairs are their own connections to the device's listener), so one device per process
leaves one loop thread and the groups unchanged.

:func:`apply` makes ``torch.distributed`` build its gloo groups on the shared device; groups created before it
keep their own. The device mirrors torch's own choice: one per interface named in ``GLOO_SOCKET_IFNAME``, else
the host's default.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

_state: dict[str, Any] = {"original": None, "devices": None, "pid": None}


def _shared_devices(gloo: Any) -> list[Any]:
    """This process's devices, created at the first gloo group (a forked child makes its own)."""
    if _state["pid"] != os.getpid():
        interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
        if interfaces:
            _state["devices"] = [gloo.create_device(interface=i) for i in interfaces]
        else:
            _state["devices"] = [gloo.create_default_device()]
        _state["pid"] = os.getpid()
    return _state["devices"]


def apply() -> None:
    """Build every later gloo process group of this process on one shared transport device. Idempotent."""
    from torch.distributed import distributed_c10d

    if _state["original"] is not None:
        return
    original = distributed_c10d.ProcessGroupGloo

    class SharedDeviceGloo(original):  # type: ignore[misc, valid-type]
        """torch's ``ProcessGroupGloo(store, rank, size, timeout)`` on the process's shared device; a
        subclass, so torch's ``isinstance(backend, ProcessGroupGloo)`` checks still hold."""

        def __init__(
            self,
            store: Any,
            rank: int,
            size: int,
            timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        ) -> None:
            options = original._Options()  # type: ignore[attr-defined]
            options._devices = _shared_devices(original)
            options._timeout = timeout
            options._threads = 2 * len(options._devices)  # torch's own count per group
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = SharedDeviceGloo  # type: ignore[misc]
    _state["original"] = original


def gloo_loop_threads() -> int:
    """How many gloo transport loop threads this process runs now (Linux ``/proc``; 0 elsewhere)."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return 0
    count = 0
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as comm:
                count += comm.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended while we looked
            continue
    return count
