"""Dry runs print the exact command every node would run (Slurm variables and hostnames simulated)."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.launch.conftest import REPO, run_script

RAY_PORTS = (
    "--node-manager-port=6380 --object-manager-port=6381 --runtime-env-agent-port=6382 "
    "--dashboard-agent-grpc-port=6383 --dashboard-agent-listen-port=6384 --metrics-export-port=6385 "
    "--min-worker-port=20000 --max-worker-port=20999"
)
RESOURCES = "--num-cpus=96 --num-gpus=8 --disable-usage-stats --block"
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "rl",
    "SLURM_CPUS_ON_NODE": "96",
    "SLURM_GPUS_ON_NODE": "8",
}


def _lines(result) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("#")]


@pytest.mark.parametrize(
    ("nodelist", "hosts"), [("gpu07", ["gpu07"]), ("gpu[01-03],gpu10", ["gpu01", "gpu02", "gpu03", "gpu10"])]
)
def test_ray_on_slurm_commands_per_node(nodelist, hosts):
    env = {**SLURM, "DRY_RUN": "1", "SLURM_JOB_NODELIST": nodelist, "HEAD_IP": "10.1.2.3"}
    env.update(RECIPE="recipes/r.yaml", OVERRIDES="trainer.total_training_steps=5 rollout.n=4")
    lines = _lines(run_script("launch/ray_on_slurm.sbatch", env=env))
    head, workers, n = hosts[0], hosts[1:], len(hosts)
    driver = (
        f"python3 -m mcore_rl.cli train recipes/r.yaml trainer.nnodes={n} trainer.n_gpus_per_node=8 "
        "trainer.ray_address=10.1.2.3:6379 trainer.total_training_steps=5 rollout.n=4"
    )
    head_cmd = (
        "ray start --head --node-ip-address=10.1.2.3 --port=6379 --ray-client-server-port=10001 "
        f"--dashboard-port=8265 {RAY_PORTS} {RESOURCES}"
    )
    worker_cmd = f"ray start --address=10.1.2.3:6379 {RAY_PORTS} {RESOURCES}"
    per_node = [f"{head}$ {head_cmd}", *(f"{w}$ {worker_cmd}" for w in workers), f"{head}$ {driver}"]
    assert lines[: len(per_node)] == per_node
    logs = f"{REPO}/logs/rl-4242-r0"
    node_exec = f"{REPO}/launch/node_exec.sh"
    srun = "srun --ntasks-per-node=1 --kill-on-bad-exit=1"
    steps = [
        f"slurm$ {srun} --nodes=1 --nodelist={head} --cpus-per-task=96 --gpus-per-node=8 "
        f"--output={logs}/ray-head-%N.log {node_exec} {head_cmd}"
    ]
    if workers:
        worker_list = "\\,".join(workers)  # printf %q escapes the commas
        steps.append(
            f"slurm$ {srun} --nodes={n - 1} --nodelist={worker_list} --cpus-per-task=96 --gpus-per-node=8 "
            f"--output={logs}/ray-worker-%N.log {node_exec} {worker_cmd}"
        )
    steps.append(
        f"slurm$ {srun} --overlap --nodes=1 --nodelist={head} --cpus-per-task=4 --output={logs}/driver.log "
        f"{node_exec} {driver}"
    )
    assert lines[len(per_node) :] == steps


def test_ray_on_slurm_container_replaces_the_venv():
    env = {
        **SLURM,
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "HEAD_IP": "10.0.0.1",
        "CONTAINER": "img.sqsh",
    }
    lines = _lines(run_script("launch/ray_on_slurm.sbatch", env=env))
    steps = [line for line in lines if line.startswith("slurm$")]
    assert len(steps) == 3
    assert all(
        f"--container-image=img.sqsh --container-mounts={REPO}:{REPO} --container-workdir={REPO}" in s
        for s in steps
    )


def test_ray_on_slurm_refuses_a_job_without_gpus():
    env = {**SLURM, "DRY_RUN": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "none"}
    result = run_script("launch/ray_on_slurm.sbatch", env=env)
    assert result.returncode == 1
    assert "SLURM_GPUS_ON_NODE='none' is not a GPU count; request --gpus-per-node" in result.stderr


@pytest.mark.parametrize("nodes", [1, 4])
def test_torchrun_sbatch_commands_per_node(nodes):
    nodelist = "a100-01" if nodes == 1 else "a100-[01-04]"
    hosts = [f"a100-0{i + 1}" for i in range(nodes)]
    env = {
        **SLURM,
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": nodelist,
        "MCORE_RL_ARGS": "convert hf-to-mcore --hf-dir /m --out /c --tp 8",
    }
    lines = _lines(run_script("launch/torchrun.sbatch", env=env))
    tool = "-m mcore_rl.cli convert hf-to-mcore --hf-dir /m --out /c --tp 8"
    expected = [
        f"{host}$ python3 -m torch.distributed.run --nnodes={nodes} --nproc-per-node=8 --node-rank={rank} "
        f"--master-addr=a100-01 --master-port=29500 {tool}"
        for rank, host in enumerate(hosts)
    ]
    expected.append(
        f"slurm$ srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=96 --gpus-per-node=8 "
        f"--output={REPO}/logs/rl-4242-r0/torchrun-%N.log {REPO}/launch/node_exec.sh {REPO}/launch/torchrun.sh "
        f"--nnodes {nodes} --nproc-per-node 8 --master-addr a100-01 --master-port 29500 --rdzv static "
        "convert hf-to-mcore --hf-dir /m --out /c --tp 8"
    )
    assert lines == expected


def test_torchrun_sbatch_needs_a_tool():
    result = run_script("launch/torchrun.sbatch", env={**SLURM, "SLURM_JOB_NODELIST": "n1"})
    assert result.returncode == 1
    assert "give the mcore-rl subcommand to run as arguments (or MCORE_RL_ARGS)" in result.stderr


def _node_words(result, host: str) -> list[str]:
    """The command a node runs, as the words its shell reads from the printed line."""
    lines = [line for line in _lines(result) if line.startswith(f"{host}$ ")]
    assert len(lines) >= 1, result.stdout
    return shlex.split(lines[-1].removeprefix(f"{host}$ "))


def test_ray_on_slurm_overrides_with_spaces_reach_the_driver_whole():
    env = {**SLURM, "DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[01-02]", "HEAD_IP": "10.1.2.3"}
    env["OVERRIDES"] = "model.path='/models/Llama 3' trainer.total_training_steps=5\nrollout.n=4"
    args = ["data.train_files=[/data/my set/train.parquet]", "rollout.n=8"]
    words = _node_words(run_script("launch/ray_on_slurm.sbatch", *args, env=env), "gpu01")
    assert words[-5:] == [  # OVERRIDES by the shell's quoting, then the arguments word for word
        "model.path=/models/Llama 3",
        "trainer.total_training_steps=5",
        "rollout.n=4",
        *args,
    ]
    refused = run_script("launch/ray_on_slurm.sbatch", env={**env, "OVERRIDES": "model.path=/it's"})
    assert refused.returncode == 1 and "OVERRIDES has an unmatched quote" in refused.stderr


def test_torchrun_sbatch_takes_the_subcommand_as_arguments():
    env = {**SLURM, "DRY_RUN": "1", "SLURM_JOB_NODELIST": "a100-[01-02]"}
    tool = ["convert", "hf-to-mcore", "--hf-dir", "/models/Llama 3.1 8B", "--out", "/ckpt/l8b"]
    result = run_script("launch/torchrun.sbatch", *tool, env=env)
    for host in ("a100-01", "a100-02"):
        assert _node_words(result, host)[-len(tool) :] == tool
    assert _node_words(result, "slurm")[-len(tool) :] == tool
    quoted = {**env, "MCORE_RL_ARGS": "convert hf-to-mcore --hf-dir '/models/Llama 3.1 8B' --out /ckpt/l8b"}
    assert _node_words(run_script("launch/torchrun.sbatch", env=quoted), "a100-02")[-len(tool) :] == tool
    both = run_script("launch/torchrun.sbatch", *tool, env=quoted)
    assert both.returncode == 1 and "both the arguments" in both.stderr


@pytest.mark.parametrize("script", ["ray_on_slurm.sbatch", "torchrun.sbatch"])
def test_sbatch_output_is_written_where_a_folder_exists(script, launch_dir):
    # Slurm does not create --output's folder: a job naming a missing one fails with no log at all.
    (output,) = re.findall(r"^#SBATCH --output=(\S+)$", (launch_dir / script).read_text(), re.M)
    assert "/" not in output  # the submit directory, where sbatch ran


def test_torchrun_sh_resolves_rendezvous_from_slurm_and_flags():
    env = {
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "g[08-09]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "GPUS_PER_NODE": "4",
    }
    result = run_script("launch/torchrun.sh", "plan", "recipes/x.yaml", env=env)
    assert result.stdout.strip() == (
        "python3 -m torch.distributed.run --nnodes=2 --nproc-per-node=4 --node-rank=1 --master-addr=g08 "
        "--master-port=29500 -m mcore_rl.cli plan recipes/x.yaml"
    )
    elastic = run_script(
        "launch/torchrun.sh",
        "--nnodes",
        "3",
        "--master-addr",
        "h1",
        "--rdzv",
        "c10d",
        "convert",
        "x",
        env={"DRY_RUN": "1", "SLURM_JOB_ID": "77", "GPUS_PER_NODE": "8"},
    )
    assert elastic.stdout.strip() == (
        "python3 -m torch.distributed.run --nnodes=3 --nproc-per-node=8 --rdzv-backend=c10d "
        "--rdzv-endpoint=h1:29500 --rdzv-id=77 -m mcore_rl.cli convert x"
    )
    single = run_script("launch/torchrun.sh", "convert", "x", env={"DRY_RUN": "1", "GPUS_PER_NODE": "2"})
    assert "--nnodes=1 --nproc-per-node=2 --node-rank=0 --master-addr=127.0.0.1" in single.stdout


def test_torchrun_sh_rejects_unknown_options():
    result = run_script("launch/torchrun.sh", "--nodes", "2", "convert", env={"DRY_RUN": "1"})
    assert result.returncode == 1
    assert "unknown option --nodes" in result.stderr


def test_local_sh_command():
    result = run_script(
        "launch/local.sh",
        "recipes/demo_cpu.yaml",
        "trainer.total_training_steps=2",
        env={"DRY_RUN": "1", "GPUS_PER_NODE": "0", "RAY_ADDRESS": "stale:1"},
    )
    assert result.stdout.strip() == (
        "python3 -m mcore_rl.cli train recipes/demo_cpu.yaml trainer.nnodes=1 trainer.total_training_steps=2"
    )
    gpus = run_script("launch/local.sh", "r.yaml", env={"DRY_RUN": "1", "GPUS_PER_NODE": "8"})
    assert (
        gpus.stdout.strip()
        == "python3 -m mcore_rl.cli train r.yaml trainer.nnodes=1 trainer.n_gpus_per_node=8"
    )


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu07", ["gpu07"]),
        ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
        ("a[1,3-4],b9", ["a1", "a3", "a4", "b9"]),
        ("rack1-n[08-10]-ib", ["rack1-n08-ib", "rack1-n09-ib", "rack1-n10-ib"]),
    ],
)
def test_dry_run_expands_slurm_nodelists(nodelist, hosts):
    result = run_script("-c", f"source launch/lib.sh && expand_nodelist '{nodelist}'")
    assert result.stdout.split() == hosts


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/local.sh"])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_scripts_usage_and_runs_nothing(script, flag):
    """torchrun.sh refused --help as an unknown option; local.sh passed it on as the recipe."""
    result = run_script(script, flag, env={"PYTHON": "/nonexistent/python"})  # a run would fail on it
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].strip().startswith(script) and "DRY_RUN=1" in result.stdout
    assert "#" not in result.stdout.splitlines()[0] and result.stderr == ""
