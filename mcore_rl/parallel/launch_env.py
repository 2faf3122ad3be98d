"""Which launch this process is part of, read from the launcher's environment variables, checked once.

``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` outlive the launch that set them: exported in
a shell, copied from a job script. A plain ``mcore-rl convert`` that trusted them waited 30 minutes for
peers that never came, or (``RANK=3``) decided it was not rank 0 and exited 0 having written nothing.

The rule: a launch is a coherent ``RANK < WORLD_SIZE``, the rendezvous address and port, and a launcher's
own mark (torchrun's ``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK``, which torchrun, Slurm wrappers and Ray
workers set), all present (``WORLD_SIZE=1`` included: a launcher's world of one). Anything else is a single process:
stale variables are replaced by a world of one on a free local port, with one note naming them; variables
that claim a multi-rank launch but contradict each other are refused in one line. A rendezvous port that
rank 0 must open but that is already taken is refused in one line too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

from mcore_rl.io.errors import note
from mcore_rl.parallel.layout import LayoutError

_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(LayoutError):
    """Launcher variables that contradict each other; the message names them."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process's launch."""

    rank: int
    """This process's global rank (0 for a single process)."""
    world_size: int
    """Processes in the launch (1 for a single process)."""
    stale: tuple[str, ...] = ()
    """Launcher variables present but ignored (a single process with leftovers from another launch)."""


def _int(env: MutableMapping[str, str], key: str, minimum: int) -> int:
    try:
        value = int(env[key])
    except ValueError:
        raise LaunchError(f"{key}={env[key]!r} is not an integer") from None
    if value < minimum:
        raise LaunchError(f"{key}={value} must be at least {minimum}")
    return value


def read_launch_env(env: MutableMapping[str, str]) -> LaunchEnv:
    """Pure: classify ``env`` (see the module docstring); raises :class:`LaunchError` when incoherent."""
    world = _int(env, "WORLD_SIZE", 1) if env.get("WORLD_SIZE", "") != "" else 1
    if world == 1:
        present = tuple(k for k in (*_RENDEZVOUS, "LOCAL_RANK") if k in env)
        # torchrun --nproc-per-node 1, or a Ray worker in a world of one: every variable set, coherently.
        launcher = "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env
        if launcher and env.get("RANK") == "0" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            _int(env, "MASTER_PORT", 1)
            return LaunchEnv(0, 1)
        return LaunchEnv(0, 1, stale=present)
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
        raise LaunchError(
            f"WORLD_SIZE={world} is set, but no launcher started this process (no TORCHELASTIC_RUN_ID or "
            "LOCAL_RANK); unset WORLD_SIZE and RANK for a single process, or launch with torchrun"
        )
    missing = [k for k in _RENDEZVOUS if env.get(k, "") == ""]
    if missing:
        raise LaunchError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun")
    rank = _int(env, "RANK", 0)
    if rank >= world:
        raise LaunchError(f"RANK={rank} is not below WORLD_SIZE={world}")
    _int(env, "MASTER_PORT", 1)
    return LaunchEnv(rank, world)


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def prepare_launch_env(env: MutableMapping[str, str] | None = None) -> LaunchEnv:
    """Make ``env`` (default ``os.environ``) describe the launch for ``init_process_group``.

    A single process gets a world of one on a free local port, stale variables replaced (one note);
    rank 0 of a launch whose store it must open itself gets a one-line error when the port is taken.
    """
    env = os.environ if env is None else env
    launch = read_launch_env(env)
    if launch.world_size == 1 and launch.stale:
        shown = ", ".join(f"{k}={env[k]}" for k in launch.stale)
        note(f"ignoring {shown}: no multi-rank launch (WORLD_SIZE unset or 1), running as a single process")
    if launch.world_size == 1 and (launch.stale or "MASTER_PORT" not in env):
        for key in launch.stale:
            env.pop(key)
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()))
        return launch
    # torchrun's agent already listens on MASTER_PORT and hands its store to the workers.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if launch.rank == 0 and not agent_store and _port_taken(env["MASTER_ADDR"], int(env["MASTER_PORT"])):
        raise LaunchError(
            f"MASTER_PORT={env['MASTER_PORT']} is already in use on this machine; choose a free port"
        )
    return launch


def current_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else the launch's (0 when single)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return read_launch_env(os.environ).rank


@contextlib.contextmanager
def rendezvous_for_init(**values: str) -> Iterator[None]:
    """``values`` (rendezvous variables: RANK, MASTER_PORT, ...) in ``os.environ`` while a world is joined, and
    every rendezvous variable as it was before (also those a world of one made up) afterwards.
    ``init_process_group`` reads them only then; left behind, they read as a launch to the next world built in
    the same process (an in-process driver run, then a test's world of one), which then checked a stale
    MASTER_PORT that was still held and failed with "already in use"."""
    saved = {k: os.environ.get(k) for k in (*_RENDEZVOUS, "LOCAL_RANK", *values)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 right now (single-node rendezvous without a launcher; tests, benches)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
