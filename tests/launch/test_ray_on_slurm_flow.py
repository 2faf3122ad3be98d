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


def _preempted_run(tmp_path, state, restart: int, signal_name: str | None, **extra: str):
    """The template as Slurm runs it, with ``signal_name`` sent to the batch script once the driver runs."""
    import signal as signals
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "activate").write_text("")
    env = {
        "PATH": f"{FAKES}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/tmp"),
        "FAKE_STATE": str(state),
        "VENV": str(venv),
        "LOG_DIR": str(tmp_path / f"logs-r{restart}"),
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": str(restart),
        "SLURM_CPUS_ON_NODE": "16",
        "SLURM_GPUS_ON_NODE": "8",
        "HEAD_IP": "10.0.0.1",
        "RECIPE": "recipes/r.yaml",
        "POLL_S": "0.2",
        "FAKE_DRIVER_CHECKPOINTS": "1",
        "FAKE_DRIVER_S": "60",
        **extra,
    }
    script = subprocess.Popen(
        ["bash", "launch/ray_on_slurm.sbatch"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    if signal_name is not None:
        deadline = time.monotonic() + 60
        while not (state / "driver_running").exists() and script.poll() is None:
            assert time.monotonic() < deadline, "the driver never started"
            time.sleep(0.1)
        time.sleep(0.3)  # inside the driver's wait
        script.send_signal(getattr(signals, f"SIG{signal_name}"))
    _, err = script.communicate(timeout=120)
    return script.returncode, err


def test_usr1_stops_the_driver_with_a_checkpoint_and_the_requeued_job_resumes(tmp_path):
    """Slurm's --signal=B:USR1 reaches the batch script: the driver alone gets it, saves while both Ray nodes
    are still up, exits 75; the job is requeued after the teardown, and the requeued job's driver (the same
    command) finds the checkpoint."""
    state = tmp_path / "state"
    state.mkdir()
    status, err = _preempted_run(tmp_path, state, 0, "USR1")
    assert status == 75, err
    assert (state / "checkpoint").read_text().strip() == "step 3 (2 Ray nodes up)"
    assert (state / "requeued").read_text().split() == ["7"]
    assert err.index("SIGUSR1: the driver ends its step") < err.index("driver exited with status 75")
    assert err.index("teardown") < err.index("requeueing job 7")
    assert not list(state.glob("gpus.*"))  # every Ray node stopped before the requeue

    (state / "driver_running").unlink()
    status, err = _preempted_run(tmp_path, state, 1, None)  # the requeued job
    assert status == 0, err
    first, second = (state / "driver").read_text().splitlines()
    assert first == second  # same command: trainer.resume_mode=auto finds the run's checkpoint
    assert (state / "resumed").read_text().strip() == "resumed from step 3 (2 Ray nodes up) (restart 1)"
    assert (state / "requeued").read_text().split() == ["7"]  # not requeued again


def test_term_is_passed_to_the_driver_and_requeues_stop_at_max_requeues(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    status, err = _preempted_run(tmp_path, state, 3, "TERM", MAX_REQUEUES="3")
    assert status == 75, err
    assert (state / "checkpoint").exists()
    assert "MAX_REQUEUES=3 reached, not requeueing" in err
    assert not (state / "requeued").exists()
