"""The Ray-on-Slurm template's control flow, run for real against a fake cluster.

Slurm, Ray and GPUs do not exist on this machine, so ``fake_cluster/`` stands in for exactly three
programs: ``srun`` (runs a step's command locally once per node), ``ray`` (a node that registers its GPUs
and blocks until TERM) and ``python3`` (the readiness probe counts the registered GPUs; the driver records
its arguments). Everything else is the template itself: the node array, the readiness gate and its
deadline, the fail-fast watch, the exit status and the teardown.
"""

from __future__ import annotations

import os
import time

from tests.launch.conftest import REPO, run_script

FAKES = REPO / "tests" / "launch" / "fake_cluster"


def _run(tmp_path, nodelist: str, **extra: str):
    state = tmp_path / "state"
    state.mkdir()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")  # the fakes are already first on PATH
    env = {
        "PATH": f"{FAKES}:{os.environ['PATH']}",
        "FAKE_STATE": str(state),
        "VENV": str(venv),
        "LOG_DIR": str(tmp_path / "logs"),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": "7",
        "SLURM_CPUS_ON_NODE": "16",
        "SLURM_GPUS_ON_NODE": "8",
        "HEAD_IP": "10.0.0.1",
        "RECIPE": "recipes/r.yaml",
        "POLL_S": "0.2",
        **extra,
    }
    start = time.monotonic()
    result = run_script("launch/ray_on_slurm.sbatch", env=env, timeout=120)
    return result, state, time.monotonic() - start


def test_driver_starts_after_every_gpu_joined_and_everything_is_torn_down(tmp_path):
    result, state, _ = _run(tmp_path, "n[1-3]")
    assert result.returncode == 0, result.stderr
    assert (state / "driver").read_text().split() == [
        "-m",
        "mcore_rl.cli",
        "train",
        "recipes/r.yaml",
        "trainer.nnodes=3",
        "trainer.n_gpus_per_node=8",
        "trainer.ray_address=10.0.0.1:6379",
    ]
    log = result.stderr
    assert log.index("8/8 GPUs in the Ray cluster") < log.index("started ray workers on n2,n3")
    assert log.index("24/24 GPUs in the Ray cluster") < log.index("started driver")
    assert "driver exited with status 0" in log
    assert sorted((state / "stops").read_text().split("\n")[:-1]) == ["stop 0", "stop 1", "stop 2"]
    assert not list(state.glob("gpus.*"))  # every fake Ray node got TERM and went away
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert {"ray-head-node0.log", "ray-worker-node0.log", "ray-worker-node1.log", "driver.log"} <= set(logs)


def test_a_dying_ray_node_fails_the_job_at_once(tmp_path):
    result, state, elapsed = _run(tmp_path, "n[1-2]", FAKE_DRIVER_KILLS_WORKERS="1", FAKE_DRIVER_S="60")
    assert result.returncode == 1
    assert "ray workers on n2 exited while the driver ran" in result.stderr
    assert elapsed < 45  # the 60 s driver was stopped, not waited for
    assert not list(state.glob("gpus.*"))


def test_gpus_that_never_join_hit_the_deadline(tmp_path):
    result, state, _ = _run(tmp_path, "n1", FAKE_RAY_GPUS="0", JOIN_DEADLINE_S="2")
    assert result.returncode == 1
    assert "only 0 of 8 GPUs joined within 2s" in result.stderr
    assert not (state / "driver").exists()
    assert not list(state.glob("gpus.*"))


def test_a_head_that_exits_before_joining_is_reported(tmp_path):
    result, _, _ = _run(tmp_path, "n[1-2]", FAKE_HEAD_FAILS="1")
    assert result.returncode == 1
    assert "ray head on n1 exited before the cluster was ready" in result.stderr


def test_the_driver_exit_status_is_the_job_status(tmp_path):
    result, _, _ = _run(tmp_path, "n1", FAKE_DRIVER_EXIT="3")
    assert result.returncode == 3
    assert "driver exited with status 3" in result.stderr
