"""Launcher variables: a real multi-rank launch is used as is, leftovers are ignored with a note, and a
contradiction or a busy port is one error line; never a wait for peers that will not come."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mcore_rl.parallel.launch_env import LaunchEnv, LaunchError, prepare_launch_env, read_launch_env

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, LaunchEnv(0, 1)),
        ({"RANK": "3"}, LaunchEnv(0, 1, stale=("RANK",))),
        ({"RANK": "0", "MASTER_PORT": "29500"}, LaunchEnv(0, 1, stale=("RANK", "MASTER_PORT"))),
        (
            {"WORLD_SIZE": "1", "RANK": "2", "LOCAL_RANK": "2"},
            LaunchEnv(0, 1, stale=("RANK", "WORLD_SIZE", "LOCAL_RANK")),
        ),
        ({"WORLD_SIZE": "", "RANK": "1"}, LaunchEnv(0, 1, stale=("RANK", "WORLD_SIZE"))),
        ({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}, LaunchEnv(0, 1)),  # torchrun --nproc-per-node 1
        (  # a Ray worker in a world of one
            {
                "WORLD_SIZE": "1",
                "RANK": "0",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "5",
            },
            LaunchEnv(0, 1),
        ),
        (  # everything but the launcher's mark: leftovers of some launch
            {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "5"},
            LaunchEnv(0, 1, stale=("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")),
        ),
        ({**TORCHRUN, "WORLD_SIZE": "4", "RANK": "3"}, LaunchEnv(3, 4)),
    ],
)
def test_read_launch_env(env, expected):
    assert read_launch_env(dict(env)) == expected


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "2", "RANK": "1"}, "no launcher started this process"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({**TORCHRUN, "WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({**TORCHRUN, "WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 must be at least 0"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT unset"),
        ({**TORCHRUN, "WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "x"}, "MASTER_PORT='x'"),
    ],
)
def test_incoherent_launch_is_one_error(env, message):
    with pytest.raises(LaunchError, match=message):
        read_launch_env(dict(env))


def test_leftovers_become_a_world_of_one_on_a_free_port(capsys):
    env = {"RANK": "3", "MASTER_PORT": "1", "LOCAL_RANK": "3", "PATH": "/bin"}
    assert prepare_launch_env(env) == LaunchEnv(0, 1, stale=("RANK", "MASTER_PORT", "LOCAL_RANK"))
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_PORT"] != "1"
    assert "LOCAL_RANK" not in env and env["PATH"] == "/bin"
    assert "ignoring RANK=3, MASTER_PORT=1, LOCAL_RANK=3" in capsys.readouterr().err


def test_a_busy_port_is_one_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        env = {
            "WORLD_SIZE": "2",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        with pytest.raises(LaunchError, match=f"MASTER_PORT={port} is already in use"):
            prepare_launch_env(env)
        # Under torchrun the agent holds the port and hands its store over: not an error.
        assert prepare_launch_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}) == LaunchEnv(0, 2)


def test_a_plain_run_with_leftover_variables_does_not_wait_for_peers(hf_tiny, tmp_path):
    """The issue's 30-minute hang: RANK and MASTER_PORT left in the shell of a single-process conversion
    (which joins a torch.distributed world). It finishes, with one note."""
    # Only the two leftovers: this test process may itself have joined a world of one earlier in the run,
    # which wrote MASTER_ADDR and the others into os.environ.
    launcher = (
        "WORLD_SIZE",
        "MASTER_ADDR",
        "LOCAL_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(RANK="1", MASTER_PORT="1", PYTHONPATH=os.getcwd())
    out = str(tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.convert", "hf-to-mcore", "--hf-dir", hf_tiny, "--out", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "ignoring RANK=1, MASTER_PORT=1" in done.stderr and os.path.isfile(
        os.path.join(out, "metadata.json")
    )


@pytest.fixture
def hf_tiny(tmp_path) -> str:
    from tests.convert.hf_models import save_hf_model

    return save_hf_model(str(tmp_path / "hf"), "llama")


def test_joining_a_world_leaves_no_rendezvous_variables_behind(monkeypatch):
    """An in-process driver run once left RANK, LOCAL_RANK and MASTER_PORT behind; the next world built in the
    same process read them as a launch and failed on the stale, still-held port."""
    import os

    from mcore_rl.engine.workers.base import Worker
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.launch_env import free_local_port

    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    worker = Worker(0, 1, num_threads=1)
    worker.init_parallel("127.0.0.1", free_local_port(), ParallelConfig())
    with worker.ctx:
        assert not [k for k in keys if k in os.environ]
