"""``mcore-rl train`` joins a running Ray cluster by address (``trainer.ray_address``): its 2 ranks run as
actors on that cluster; one killed with kill -9 in the middle of the run ends it within seconds naming the
rank, exit 1, and the cluster is left without the run's actors and placement groups.

The head is ``ray start --head --block`` in a process of its own session, ended by its process group in
teardown. (Not ``ray stop``: that kills every Ray process on the machine, other users' clusters too.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from mcore_rl.parallel.launch_env import free_local_port
from tests.trainer.common import demo_recipe_overrides, tiny_run_config

pytestmark = pytest.mark.slow
MARK = "mcore_rl_test_head"  # a custom resource only our head has: proves which cluster ran the work
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    import ray

    if ray.is_initialized():  # connect to our head below, not to a session an earlier module left
        ray.shutdown()
    port, temp = free_local_port(), tempfile.mkdtemp(prefix="rayhead_", dir="/tmp")
    command = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--resources={json.dumps({MARK: 1})}",
        f"--object-store-memory={128 << 20}",
        f"--temp-dir={temp}",
        "--block",
    ]
    log_path = os.path.join(temp, "head.log")
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    try:
        _wait_for(lambda: "Ray runtime started" in _read(log_path), 90, f"ray start; see {log_path}")
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.terminate()  # --block: ray start stops the head's processes on SIGTERM
        try:
            head.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # whatever of our head's session is left
            shutil.rmtree(temp, ignore_errors=True)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s} s")
        time.sleep(0.5)


def test_train_joins_the_cluster_by_address_and_a_kill_9_ends_it_fast_and_clean(ray_head, tmp_path) -> None:
    import ray
    from ray._private.state import actors as actor_table  # pids of the cluster's actors (no dashboard)
    from ray.util.placement_group import placement_group_table

    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    tiny_run_config(data)
    command = [
        *(sys.executable, "-m", "mcore_rl.cli", "train", "recipes/demo_cpu.yaml"),
        *demo_recipe_overrides(data, run),
        *(
            "sft.enable=false",
            "data.test_files=[]",
            "trainer.test_freq=-1",
            "trainer.total_training_steps=500",
            "trainer.max_restarts=0",  # fail fast (the default recovers: tests/trainer/test_recovery.py)
        ),
        *("trainer.n_gpus_per_node=2", f"trainer.ray_address={ray_head}"),
    ]
    train = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        metrics = os.path.join(run, "logs", "metrics.jsonl")
        _wait_for(
            lambda: train.poll() is not None or (os.path.exists(metrics) and '"rl"' in _read(metrics)),
            240,
            "the first RL step",
        )
        assert train.poll() is None, train.communicate()[1][-3000:]
        ray.init(address=ray_head)
        assert ray.cluster_resources().get(MARK) == 1.0  # this is our head's cluster ...
        alive = [  # ... and the run's 2 ranks are actors on it
            a
            for a in actor_table().values()
            if a["ActorClassName"] == "HybridWorker" and a["State"] == "ALIVE"
        ]
        assert len(alive) == 2
        os.kill(alive[-1]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = train.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
        named = re.search(r"mcore-rl train: error: rank [01] failed in \w+: its process died", err)
        assert named, err[-3000:]
        print(f"train ended {elapsed:.1f} s after the kill, exit {train.returncode}: {named.group(0)[:300]}")
        assert train.returncode == 1 and elapsed < 20

        def freed() -> bool:
            workers = [a for a in actor_table().values() if a["ActorClassName"] == "HybridWorker"]
            return all(a["State"] == "DEAD" for a in workers) and all(
                g["state"] == "REMOVED" for g in placement_group_table().values()
            )

        _wait_for(freed, 20, "actors dead and placement groups removed")
    finally:
        if train.poll() is None:
            train.kill()
            train.communicate()
        ray.shutdown()
