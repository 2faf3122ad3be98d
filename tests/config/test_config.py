"""Run config: YAML round trips of every section, recipe inheritance, overrides, the Python API, and one
table of broken configs whose errors must name the offending key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import (
    CONFIG_FILE,
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    check_config,
    config_to_yaml,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo_cpu.yaml"
TINY_ARCH = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 14,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}

# One non-default value per section (nested sections included): each must survive YAML unchanged.
SECTION_CHANGES = {
    "model": ["model.dtype=bfloat16", "model.load_weights=false", "model.tokenizer_path=tok"],
    "parallel": ["parallel.backend=gloo", "parallel.timeout_minutes=5"],
    "rollout": ["rollout.top_p=0.9", "rollout.top_k=5", "rollout.stop_token_ids=[3,4]"],
    "rollout.val_kwargs": ["rollout.val_kwargs.temperature=0.5", "rollout.val_kwargs.n=2"],
    "rollout.hybrid": ["rollout.hybrid.sleep_level=2", "rollout.hybrid.rollout_dtype=bfloat16"],
    "algorithm": ["algorithm.adv_estimator=rloo", "algorithm.use_kl_loss=true", "algorithm.ppo_epochs=2"],
    "algorithm.kl_ctrl": ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=50"],
    "optim": ["optim.lr_decay_style=cosine", "optim.min_lr=1e-6", "optim.lr_warmup_steps=3"],
    "data": ["data.shuffle=false", "data.val_batch_size=50", "data.skip_bad_rows=true"],
    "reward": [
        "reward.num_workers=2",
        "reward.sources={my/src: exact_match}",
        "reward.gsm8k_method=flexible",
    ],
    "trainer": ["trainer.save_freq=10", "trainer.resume_mode=disable", "trainer.max_ckpt_to_keep=2"],
    "logging": ["logging.tensorboard=true", "logging.token_mult_prob_error_threshold=1.2"],
    "sft": ["sft.total_steps=7", "sft.target_val_accuracy=0.5", "sft.max_length=20"],
    "sft.optim": ["sft.optim.lr=3e-4", "sft.optim.lr_decay_style=linear"],
}


@pytest.mark.parametrize("section", list(SECTION_CHANGES))
def test_every_section_round_trips_through_yaml(section: str, tmp_path: Path) -> None:
    cfg = load_config(DEMO, SECTION_CHANGES[section])
    default = load_config(DEMO)
    node = section.split(".")
    assert _get(cfg, node) != _get(default, node), "the overrides must change the section"
    folder = save_config(cfg, tmp_path).parent
    assert (folder / CONFIG_FILE).is_file()
    assert load_config(folder / CONFIG_FILE) == cfg


def _get(cfg: object, path: list[str]) -> object:
    for part in path:
        cfg = getattr(cfg, part)
    return cfg


def test_defaults_chain_and_overrides_apply_in_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "parent.yaml").write_text(f"defaults: [{DEMO}]\nrollout:\n  n: 4\n  top_k: 3\n")
    (tmp_path / "sub" / "child.yaml").write_text("defaults: [../parent]\nrollout:\n  n: 6\n")
    cfg = load_config(tmp_path / "sub" / "child.yaml", ["rollout.top_k=7", "rollout.top_k=9"])
    assert (cfg.rollout.n, cfg.rollout.top_k) == (6, 9)  # child over parent, later override wins
    assert cfg.data.train_batch_size == 16  # from the demo recipe two levels up
    # interpolations follow the final values
    assert cfg.rollout.response_length == cfg.data.max_response_length == 6
    assert load_config(DEMO, ["data.max_response_length=9"]).rollout.response_length == 9
    assert load_config(DEMO, ["data.train_batch_size=32"]).algorithm.ppo_mini_batch_size == 32


def test_a_parent_named_with_a_dot_is_that_file(tmp_path: Path) -> None:
    # "llama3.1_8b" with .yaml added, not its last dot replaced (which loaded llama3.yaml)
    (tmp_path / "llama3.yaml").write_text(f"defaults: [{DEMO}]\nrollout:\n  top_k: 2\n")
    (tmp_path / "llama3.1_8b.yaml").write_text(f"defaults: [{DEMO}]\nrollout:\n  top_k: 3\n")
    (tmp_path / "child.yaml").write_text("defaults: [llama3.1_8b]\n")
    assert load_config(tmp_path / "child.yaml").rollout.top_k == 3
    assert load_config(tmp_path / "llama3.1_8b").rollout.top_k == 3


def test_self_marker_puts_the_recipe_before_its_parents(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(f"defaults: [_self_, {DEMO}]\nrollout:\n  n: 2\n")
    assert load_config(tmp_path / "a.yaml").rollout.n == 8  # the parent, merged after, wins


def test_python_api_builds_and_checks_configs() -> None:
    cfg = RunConfig(
        model=ModelConfig(hf_config=dict(TINY_ARCH), tokenizer_path="tok"),
        data=DataConfig(
            train_files=["t.parquet"], train_batch_size=8, max_prompt_length=8, max_response_length=8
        ),
    )
    cfg.rollout.n = 4
    checked = check_config(cfg)
    assert checked.algorithm.ppo_mini_batch_size == 8  # interpolation resolved
    assert checked.rollout.response_length == 8
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length \+ data\.max_response_length"):
        check_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_length=512)))
    cfg.data.train_batch_size = "many"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"data\.train_batch_size"):
        check_config(cfg)


def test_component_configs_come_from_the_sections() -> None:
    cfg = load_config(DEMO, ["rollout.stop_token_ids=[5,1]", "rollout.hybrid.rollout_dtype=bfloat16"])
    params = cfg.rollout.sampling_params(eos_token_id=1, pad_token_id=0, seed=3)
    assert params.stop_token_ids == (1, 5) and params.n == 8 and params.max_new_tokens == 6
    greedy = cfg.rollout.sampling_params(eos_token_id=1, pad_token_id=0, seed=3, validation=True)
    assert greedy.greedy and greedy.n == 1
    assert cfg.rollout.hybrid.rollout_dtype == "bfloat16"
    assert cfg.optim.adam_beta2 == 0.99
    assert cfg.parallel.layout(cfg.world_size).dp == 1
    assert cfg.model.arch().vocab_size == 14


def test_choices_are_the_algorithms_enums() -> None:
    from mcore_rl.algo.settings import AdvEstimator, LossAggMode, parse_kl_estimator

    for mode in LossAggMode:
        assert load_config(DEMO, [f"algorithm.loss_agg_mode={mode.value}"]).algorithm.loss_agg_mode == mode
    for estimator in AdvEstimator:  # every estimator the enum names is accepted (GAE also needs a critic)
        # (the demo recipe's token-mean would contradict Dr.GRPO's aggregation: null follows the estimator)
        overrides = [f"algorithm.adv_estimator={estimator.value}", "algorithm.loss_agg_mode=null"]
        assert load_config(DEMO, overrides).algorithm.adv_estimator == estimator
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "low_var_kl+"):
        assert load_config(DEMO, [f"algorithm.kl_loss_type={name}"]).algorithm.kl_loss_type == name
        parse_kl_estimator(name)
    assert load_config(DEMO, ["algorithm.adv_estimator=reinforce++"]).algorithm.adv_estimator == (
        "reinforce_plus_plus"
    )
    with pytest.raises(
        ConfigError,
        match=r"algorithm.loss_agg_mode='token-avg' is not allowed; choose one of: null, token-mean",
    ):
        load_config(DEMO, ["algorithm.loss_agg_mode=token-avg"])


def test_dr_grpo_settles_its_loss_and_normalisation_or_refuses_others() -> None:
    """Dr.GRPO replaced an explicit loss_agg_mode (and std normalisation) in silence, the config saying
    token-mean while the loss ran seq-mean-token-sum-norm."""
    grpo = load_config(None, rules=False).algorithm
    assert (grpo.aggregation, grpo.norm_by_std) == ("token-mean", True)
    dr = load_config(None, ["algorithm.adv_estimator=dr_grpo"], rules=False).algorithm
    assert (dr.aggregation, dr.norm_by_std) == ("seq-mean-token-sum-norm", False)
    with pytest.raises(ConfigError, match=r"algorithm\.loss_agg_mode=token-mean: dr_grpo aggregates by"):
        load_config(DEMO, ["algorithm.adv_estimator=dr_grpo"])
    with pytest.raises(ConfigError, match=r"algorithm\.norm_adv_by_std_in_grpo=true: dr_grpo"):
        load_config(
            None, ["algorithm.adv_estimator=dr_grpo", "algorithm.norm_adv_by_std_in_grpo=true"], rules=False
        )
    from mcore_rl.trainer.step import loss_settings

    cfg = load_config(DEMO, ["algorithm.adv_estimator=dr_grpo", "algorithm.loss_agg_mode=null"])
    assert loss_settings(cfg).loss_agg_mode == "seq-mean-token-sum-norm"


def test_verl_clip_ratio_points_at_both_bounds() -> None:
    for key in ("algorithm.clip_ratio", "actor_rollout_ref.actor.clip_ratio"):
        with pytest.raises(
            ConfigError, match=r"set both algorithm\.clip_ratio_low and algorithm\.clip_ratio_high"
        ):
            load_config(DEMO, [f"{key}=0.28"])


def test_config_show_prints_the_resolved_config() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mcore_rl.cli", "config", "show", str(DEMO), "rollout.n=4"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "  'n': 4\n" in out.stdout and "response_length: 6" in out.stdout
    bad = subprocess.run(
        [*cmd, "rollout.m=4"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert bad.returncode == 1 and "rollout.m" in bad.stderr and "\n" not in bad.stderr.strip()  # as `train`


# (overrides, text the one error must contain). The recipe is the valid CPU demo.
BAD_CONFIGS = [
    (  # both found by the workers' reshard plan only, after they started
        [
            "trainer.n_gpus_per_node=4",
            "rollout.tensor_model_parallel_size=4",
            "model.hf_config.intermediate_size=510",
        ],
        "rollout.tensor_model_parallel_size=4 does not divide the intermediate_size=510",
    ),
    (
        [
            "trainer.n_gpus_per_node=6",
            "parallel.tensor_model_parallel_size=2",
            "rollout.tensor_model_parallel_size=3",
            "model.hf_config.num_attention_heads=6",
            "model.hf_config.num_key_value_heads=6",
            "model.hf_config.hidden_size=96",
            "model.hf_config.intermediate_size=96",
        ],
        "rollout.tensor_model_parallel_size=3 and parallel.tensor_model_parallel_size=2 must nest",
    ),
    (["data.trian_files=[a]"], "data.trian_files"),
    (["rollout.temprature=1"], "rollout.temprature"),
    (["rollout.val_kwargs.top_k=-5"], "rollout.val_kwargs.top_k"),
    (["rollout.top_k=-2"], "rollout.top_k"),
    (["algorithm.kl_ctrl.kind=fixed"], "algorithm.kl_ctrl.kind"),
    (["data.train_batch_size=abc"], "data.train_batch_size"),
    (["trainer.save_freq=often"], "trainer.save_freq"),
    (["rollout.hybrid.offload_optimizer=maybe"], "rollout.hybrid.offload_optimizer"),
    (["model=3"], "model: expected a section"),
    (["rollout.n"], "not of the form dotted.key=value"),
    (["rollout.stop_token_ids={a: 1"], "rollout.stop_token_ids"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo' is not allowed; choose one of: grpo"),
    (
        ["algorithm.loss_agg_mode=mean"],
        "algorithm.loss_agg_mode='mean' is not allowed; choose one of: null, token",
    ),
    (["algorithm.kl_loss_type=k4"], "algorithm.kl_loss_type"),
    (["optim.lr_decay_style=step"], "optim.lr_decay_style"),
    (["trainer.resume_mode=latest"], "trainer.resume_mode='latest'"),
    (["model.dtype=float64"], "model.dtype"),
    (["rollout.name=sglang"], "rollout.name"),
    (["rollout.top_p=0"], "rollout.top_p=0.0 must be in (0, 1]"),
    (["rollout.n=0"], "rollout.n=0 must be > 0"),
    (["optim.adam_beta2=1.0"], "optim.adam_beta2"),
    (["sft.optim.lr=-1"], "sft.optim.lr"),
    (["algorithm.clip_ratio_c=1.0"], "algorithm.clip_ratio_c"),
    (["trainer.test_freq=0"], "trainer.test_freq"),
    (
        ["trainer.n_gpus_per_node=3", "parallel.tensor_model_parallel_size=2"],
        "does not divide the world size 3",
    ),
    (["parallel.tensor_model_parallel_size=8", "trainer.n_gpus_per_node=8"], "num_attention_heads=4"),
    (
        ["rollout.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=3"],
        "rollout.tensor_model_parallel_size=3",
    ),
    (["parallel.data_parallel_size=2"], "parallel.data_parallel_size=2"),
    (  # a model folder not here: the world-size rule alone (the batch rules divided by a DP size of 0)
        ["trainer.n_gpus_per_node=2", "parallel.context_parallel_size=4", "model.path=/not/here"],
        "= 1 * 1 * 4 = 4 does not divide the world size 2",
    ),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["parallel.virtual_pipeline_model_parallel_size=2"], "parallel.virtual_pipeline_model_parallel_size"),
    (["parallel.pipeline_model_parallel_size=4", "trainer.n_gpus_per_node=4"], "num_layers=2"),
    (["algorithm.ppo_mini_batch_size=5"], "not divisible by algorithm.ppo_mini_batch_size=5"),
    (["algorithm.ppo_micro_batch_size_per_gpu=48"], "ppo_micro_batch_size"),
    (["trainer.n_gpus_per_node=32", "data.train_batch_size=16"], "rollout replicas"),
    (["rollout.n=1"], "rollout.n=1"),
    (["data.max_prompt_length=30"], "max_position_embeddings=32"),
    (["sft.train_batch_size=60"], "sft.micro_batch_size_per_gpu=64"),
    (["sft.train_files=[]"], "sft.enable=true needs sft.train_files"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
    (["data.val_files=[]"], "trainer.test_freq=50 needs data.val_files"),
    (["data.train_files=[]"], "data.train_files is empty"),
    (["optim.min_lr=1.0"], "optim.min_lr=1.0 exceeds optim.lr"),
    (["model.hf_config.vocab_size=0"], "vocab_size must be a positive integer"),
    (["model.hf_config.num_attention_heads=6"], "num_attention_heads=6"),
    (["data.generate=gsm8k"], "data.generate"),
    (["reward.on_error=ignore"], "reward.on_error"),
    (
        ["rollout.colocate=false", "rollout.num_ranks=3", "rollout.tensor_model_parallel_size=2"],
        "does not divide rollout.num_ranks=3",
    ),
    (["rollout.colocate=false", "rollout.num_ranks=32"], "the 32 rollout replicas"),
    (["rollout.num_ranks=0"], "rollout.num_ranks=0 must be > 0"),
    (["algorithm.rollout_is_threshold=1.0"], "algorithm.rollout_is_threshold"),
    (
        ["algorithm.use_kl_in_reward=true"],
        "algorithm.use_kl_in_reward=true needs algorithm.adv_estimator=gae",
    ),
    (
        [
            "algorithm.ppo_max_token_len_per_gpu=256",
            "parallel.pipeline_model_parallel_size=2",
            "trainer.n_gpus_per_node=2",
            "model.use_remove_padding=false",
            "model.share_prompt_prefix=false",
        ],
        "algorithm.ppo_max_token_len_per_gpu=256 makes micro-batches of unequal shapes",
    ),
    (["rollout.temperature=0"], "rollout.temperature=0: training samples at this temperature"),
    (["algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl=0.0 must be > 0"),
]


def test_a_rollout_pool_is_checked_against_its_own_ranks() -> None:
    """A 1-rank actor with a TP2 rollout pool of 2 ranks is valid (TP2 divides the pool, not the actor)."""
    cfg = load_config(
        DEMO, ["rollout.colocate=false", "rollout.num_ranks=2", "rollout.tensor_model_parallel_size=2"]
    )
    assert cfg.world_size == 1 and cfg.rollout.num_ranks == 2


@pytest.mark.parametrize(("overrides", "expected"), BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_bad_config_errors_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides)
    assert expected in str(info.value)


def test_unknown_key_lists_the_allowed_keys_and_the_file(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{DEMO}]\ndata:\n  train_file: x.parquet\n  zzz: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe)
    heading, typo, unknown = str(info.value).split("\n  ")  # both named, each on a line of its own
    assert heading == "2 keys refused:" and typo.endswith(";")
    typo = typo[:-1]
    assert typo == f"unknown key data.train_file ({recipe}); did you mean data.train_files?"
    assert unknown.startswith(
        f"unknown key data.zzz ({recipe}); keys allowed under data: train_files, val_files"
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("data.train_files=/d/train.parquet", ["/d/train.parquet"]),  # verl's scripts pass one path
        ("data.train_files=[/d/a.parquet,/d/b.parquet]", ["/d/a.parquet", "/d/b.parquet"]),
        ("data.train_files=${data.test_files}", ["runs/demo_rev_data/test.parquet"]),  # resolved, a list
    ],
)
def test_a_single_file_is_a_list_of_one(given: str, expected: list[str]) -> None:
    assert load_config(DEMO, [given]).data.train_files == expected


def test_single_values_and_null_for_lists_in_a_recipe(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"defaults: [{DEMO}]\ndata:\n  val_files: null\n  test_files: t.parquet\n"
        "rollout:\n  stop_token_ids: 7\n  multi_turn:\n    tools: tools.yaml\n"
    )
    cfg = load_config(recipe, rules=False)
    assert cfg.data.val_files == [] and cfg.data.test_files == ["t.parquet"]
    assert cfg.rollout.stop_token_ids == [7] and cfg.rollout.multi_turn.tools == ["tools.yaml"]
    with pytest.raises(ConfigError, match=r"rollout\.stop_token_ids"):  # still typed: not an id
        load_config(DEMO, ["rollout.stop_token_ids=eos"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("defaults: [missing]\n", "missing.yaml: recipe not found"),
        ("defaults: [self]\n", "defaults form a cycle"),
        ("defaults: base\n", "defaults must be a list"),
        ("- a\n- b\n", "a recipe must be a mapping"),
        ("data: [\n", "not valid YAML"),
    ],
)
def test_bad_recipe_files_are_named(text: str, expected: str, tmp_path: Path) -> None:
    recipe = tmp_path / "self.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(recipe)


def test_missing_paths_are_named_only_when_asked(tmp_path: Path) -> None:
    cfg = load_config(DEMO, [f"data.train_files=[{tmp_path}/none.parquet]"])
    assert cfg.data.train_files == [f"{tmp_path}/none.parquet"]
    with pytest.raises(ConfigError, match=rf"data\.train_files: {tmp_path}/none\.parquet does not exist"):
        load_config(DEMO, [f"data.train_files=[{tmp_path}/none.parquet]"], check_paths=True)
    # a folder where a data file belongs is said to be one, not to be missing
    with pytest.raises(ConfigError, match=rf"data\.train_files: {tmp_path} is a folder, not a data file"):
        load_config(DEMO, [f"data.train_files=[{tmp_path}]"], check_paths=True)


def test_yaml_text_is_the_schema_order() -> None:
    text = config_to_yaml(load_config(DEMO))
    tops = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(" ")]
    assert tops == [f.name for f in dataclasses.fields(RunConfig)]


def test_a_run_in_this_process_refuses_more_than_one_rank_naming_the_keys() -> None:
    """``mcore-rl train demo_cpu_tp2 --in-process`` used to pass the config, claim the run folder and then fail
    as an internal error; an automatic rank count stops at one instead."""
    with pytest.raises(
        ConfigError, match=r"trainer.n_gpus_per_node x trainer.nnodes = 4 ranks.*--in-process"
    ):
        load_config("recipes/demo_cpu_tp2.yaml", max_ranks=1)
    assert load_config("recipes/demo_cpu.yaml", ["trainer.n_gpus_per_node=null"], max_ranks=1).world_size == 1
