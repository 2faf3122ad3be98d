"""``trainer.n_gpus_per_node: null`` resolves to this machine's ranks (``config/machine.py``): torchrun's
``LOCAL_WORLD_SIZE`` first, else on CPU one rank per vCPU (``trainer.num_cpus``), the most the batch sizes,
the layout and the host's memory allow; a count the recipe sets is kept; an in-process run stops at one.
``optim.use_distributed_optimizer: null`` shards on GPUs and not on CPU ranks."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from mcore_rl.config import ConfigError, RunConfig, check_config, load_config, machine, schema_node
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.trainer.run_notes import fast_path_note
from tests.models import tiny_hf_config

# 4 prompts x 4 samples = 16 sequences per mini-batch, micro-batches of 4 unless a test says otherwise
BATCH = ["data.train_batch_size=4", "rollout.n=4", "algorithm.ppo_micro_batch_size_per_gpu=4"]


def _cfg(*overrides: str, max_ranks: int | None = None) -> RunConfig:
    node = OmegaConf.merge(schema_node(), {"model": {"hf_config": tiny_hf_config("llama")}})
    base = ["data.train_files=[unused.parquet]", "data.max_prompt_length=16", "data.max_response_length=16"]
    base += ["trainer.device=cpu", *BATCH]
    dotlist = OmegaConf.from_dotlist([*base, *overrides])
    return check_config(OmegaConf.merge(node, dotlist), max_ranks=max_ranks)


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_auto_is_one_single_threaded_rank_per_vcpu() -> None:
    assert RunConfig().trainer.n_gpus_per_node is None  # auto until resolved
    cfg = _cfg("trainer.num_cpus=4")
    assert cfg.trainer.n_gpus_per_node == 4 and cfg.world_size == 4
    note = fast_path_note(cfg)
    assert "trainer.n_gpus_per_node=4 (1 thread per rank)" in note
    assert "optim.use_distributed_optimizer=false" in note


def test_auto_takes_the_most_ranks_the_batch_sizes_allow() -> None:
    # 16 sequences over 4 ranks are 4 each, which micro-batches of 8 do not divide; over 2 ranks they do
    assert _cfg("trainer.num_cpus=4", "algorithm.ppo_micro_batch_size_per_gpu=8").world_size == 2
    # 3 vCPUs: 16 sequences do not split over 3 ranks
    assert _cfg("trainer.num_cpus=3").world_size == 2
    # a tensor-parallel size of 2 needs an even count
    assert _cfg("trainer.num_cpus=3", "parallel.tensor_model_parallel_size=2").world_size == 2


def test_a_count_the_recipe_sets_is_kept_and_checked() -> None:
    assert _cfg("trainer.num_cpus=4", "trainer.n_gpus_per_node=1").world_size == 1
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu=8 does not divide the 4 sequences"):
        _cfg("trainer.n_gpus_per_node=4", "algorithm.ppo_micro_batch_size_per_gpu=8")


def test_an_in_process_run_stops_at_one_rank() -> None:
    assert _cfg("trainer.num_cpus=4", max_ranks=1).world_size == 1


def test_torchrun_decides_when_it_launched_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _cfg("trainer.num_cpus=4").world_size == 2
    assert machine.node_devices(_cfg("trainer.num_cpus=4", "trainer.n_gpus_per_node=1"), "cpu") == 2


def test_the_host_memory_bounds_cpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg("trainer.n_gpus_per_node=1")
    arch = cfg.model.arch()
    fp32_full_finetune = machine.model_params(arch) * (2 * 4 + 12)  # weights, rollout copy, grads, Adam
    # memory for the training state of 2 ranks in the share the ranks may take
    monkeypatch.setattr(machine, "host_memory_limit", lambda: machine.MEMORY_SHARE * 2 * fp32_full_finetune)
    assert _cfg("trainer.num_cpus=4").world_size == 2
    monkeypatch.setattr(machine, "host_memory_limit", lambda: 1)
    assert _cfg("trainer.num_cpus=4").world_size == 1


def test_no_count_that_fits_leaves_the_devices_count_for_the_error_to_name() -> None:
    # 16 sequences per mini-batch never split into micro-batches of 32
    with pytest.raises(ConfigError, match="does not divide the 4 sequences per data-parallel rank"):
        _cfg("trainer.num_cpus=4", "algorithm.ppo_micro_batch_size_per_gpu=32")


def test_the_world_size_of_an_unchecked_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.n_gpus_per_node=null"):
        _ = RunConfig().world_size


def test_recipes_resolve_to_a_count_and_config_show_prints_it() -> None:
    assert load_config("recipes/demo_cpu.yaml").trainer.n_gpus_per_node == 1  # the demo sets one rank


@pytest.mark.parametrize(
    ("setting", "cpu", "cuda"), [(None, False, True), (True, True, True), (False, False, False)]
)
def test_the_distributed_optimizer_shards_on_gpus_by_default(setting, cpu, cuda) -> None:
    optim = OptimConfig(use_distributed_optimizer=setting)
    assert (optim.distributed_on("cpu"), optim.distributed_on("cuda")) == (cpu, cuda)
    assert RunConfig().optim.use_distributed_optimizer is None  # the run's default: by device
    assert RunConfig().critic.optim.use_distributed_optimizer is None


def test_a_rollout_pool_of_its_own_takes_its_devices_first() -> None:
    pool = ["rollout.colocate=false", "rollout.num_ranks=2"]
    assert _cfg("trainer.num_cpus=4", *pool).world_size == 2
    assert _cfg("trainer.num_cpus=2", *pool).world_size == 1  # at least one actor rank


@pytest.mark.gpu
def test_on_a_gpu_machine_auto_takes_every_gpu_and_shards_the_optimizer() -> None:
    import torch

    cfg = _cfg(
        "trainer.device=auto",
        "data.train_batch_size=8",
        "rollout.n=8",
        "algorithm.ppo_micro_batch_size_per_gpu=1",
    )
    assert machine.node_devices(cfg, "cuda") == torch.cuda.device_count()
    assert cfg.world_size == torch.cuda.device_count()  # 64 sequences split over any count up to 8 GPUs
    assert cfg.optim.distributed_on("cuda")
