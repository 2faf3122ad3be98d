"""Schema sections for the run around the model: ``data``, ``reward``, ``trainer``, ``logging``, ``sft``, and
:class:`RunConfig`, the root that holds every section (see :mod:`mcore_rl.config` for the whole tree)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from mcore_rl.config.critic import CriticConfig
from mcore_rl.config.dpo import DPOConfig
from mcore_rl.config.model import (
    AlgorithmConfig,
    ModelConfig,
    OptimConfig,
    ParallelSection,
    RolloutConfig,
)
from mcore_rl.config.reward_model import RewardModelConfig


@dataclass
class DataConfig:
    """Prompt datasets in verl's format (verl's ``data`` keys): jsonl or parquet rows with ``prompt`` (chat
    messages or plain text), ``data_source``, ``reward_model.ground_truth`` and ``extra_info``."""

    train_files: list[str] = field(default_factory=list)
    """Training prompt files (.parquet, .jsonl), read in order and concatenated."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompts, scored every ``trainer.test_freq`` steps."""
    test_files: list[str] = field(default_factory=list)
    """Held-out test prompts, scored before training and at the end only."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    reward_fn_key: str = "data_source"
    """Column whose value picks the reward function."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, chat template included."""
    max_response_length: int = 512
    """Longest response in tokens (``rollout.response_length`` follows it)."""
    train_batch_size: int = 1024
    """Prompts per RL step, over all data-parallel ranks."""
    val_batch_size: int | None = None
    """Prompts per validation generate call; None: the whole validation set at once."""
    filter_overlong_prompts: bool = False
    """True drops prompts longer than ``max_prompt_length`` with one counted warning; False refuses them,
    naming the file and row."""
    skip_bad_rows: bool = False
    """True skips rows missing a needed column (counted, one warning); False stops naming file, row, column."""
    apply_chat_template: bool = True
    """Render message-list prompts through the tokenizer's chat template (plain-text prompts are encoded
    as they are)."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (deterministic from ``seed`` and the epoch)."""
    seed: int = II("trainer.seed")
    """Shuffle seed; follows ``trainer.seed``."""
    drop_last: bool = True
    """Drop an epoch's last incomplete batch (every step then has ``train_batch_size`` prompts)."""
    generate: str | None = None
    """A built-in task ('arithmetic'; 'arithmetic_reversed' writes the answers least-significant digit
    first) whose generator writes the files named by ``train_files``, ``val_files``, ``test_files``,
    ``sft.train_files`` and the tokenizer at ``model.tokenizer_path`` when they are missing (see
    :mod:`mcore_rl.data.demo_task`); None: the files must exist."""


@dataclass
class RewardConfig:
    """Rule rewards (verl's ``default_compute_score`` dispatch by ``data_source``) and user scorers."""

    custom_function: str | None = None
    """A user scorer for every row, ``module:function`` or ``path/to/file.py:function``, called as
    ``fn(data_source, solution_str, ground_truth, extra_info)`` and returning a float or a dict with
    ``score`` plus extra metrics. None: the built-in dispatch."""
    sources: dict[str, str] = field(default_factory=dict)
    """Extra ``data_source -> scorer`` entries: a built-in name (gsm8k, math, exact_match) or a
    ``module:function`` / ``file.py:function`` spec. They take precedence over the built-in table."""
    on_error: str = "zero"
    """A scorer that raises or returns NaN: zero (score 0, counted, one warning per kind) or raise (stop,
    naming the row)."""
    num_workers: int = 0
    """Scorer worker processes; 0 scores in the calling process (no timeout protection)."""
    timeout_s: float = 10.0
    """Per-answer limit in a worker; past it the worker is killed and replaced, and the answer scores 0."""
    gsm8k_method: str = "strict"
    """GSM8K answer extraction: strict (the last ``#### number``) or flexible (the last number)."""
    format_score: float = 0.0
    """Score of a well-formed but wrong answer (GSM8K and the format checks)."""


@dataclass
class TrainerConfig:
    """The run: length, schedule of validation and checkpoints, placement (verl's ``trainer`` keys)."""

    project_name: str = "mcore_rl"
    experiment_name: str = "run"
    total_epochs: int = 1
    """Passes over the training prompts; ``total_training_steps`` wins when set."""
    total_training_steps: int | None = None
    """RL steps to run; None: ``total_epochs`` worth of batches."""
    test_freq: int = -1
    """Validate every this many steps (-1: never during training)."""
    val_before_train: bool = True
    """Validate (and score the held-out test set) before the first step."""
    save_freq: int = -1
    """Save a run checkpoint every this many steps and after the last one; -1 never saves."""
    resume_mode: str = "auto"
    """auto (the latest checkpoint in ``default_local_dir`` when there is one), disable, or resume_path
    (``resume_from_path``)."""
    resume_from_path: str | None = None
    """Checkpoint folder to resume from with ``resume_mode=resume_path``."""
    max_ckpt_to_keep: int | None = None
    """Keep the last K checkpoints; None keeps all."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Run output folder: checkpoints, logs and the resolved ``config.yaml``."""
    seed: int = 1
    """Seed of model init, data order and sampling."""
    nnodes: int = 1
    """Nodes in the run."""
    n_gpus_per_node: int = 1
    """Ranks per node: GPUs, or worker processes on CPU. World size = nnodes * n_gpus_per_node."""
    device: str = "auto"
    """auto (cuda when available), cuda or cpu."""
    ray_address: str | None = None
    """An existing Ray cluster (``ray start``) to join; None starts a local one."""
    num_cpus: int | None = None
    """CPUs for a local Ray; None takes them from the environment (Slurm / cgroup), never a guess."""
    on_nonfinite_loss: str = "stop"
    """A NaN/inf loss or grad norm: stop (no update is written, the step is named) or skip the update."""
    overlap_stages: bool = True
    """PPO: after each rollout, start scoring, critic values and actor/reference log-probs together (they
    depend only on the rollout), and then the critic's and the actor's updates together (they read the same
    batch); False runs them one after another (a timing baseline: same numbers)."""
    one_step_off: bool = False
    """Generate the next step's rollout before this step's update, with the weights the update starts from
    (verl's one-step-off data flow: a policy lag of 1, logged as ``policy_lag``). The PPO ratio's old
    log-probs are recomputed by the current actor, so clipping is centred on the policy being updated, and the
    policy gradient is importance-weighted from the rollout policy to that one
    (``algorithm.rollout_is_threshold``); the mismatch shows in ``token_mult_prob_error``. Colocated rollout
    engines (``rollout.colocate``) run the two one after the other; a rollout pool of its own generates while
    the actor updates. Run checkpoints hold the pending rollout, so a resumed run continues exactly. False:
    on-policy."""


@dataclass
class LoggingConfig:
    """What the run reports and where."""

    log_dir: str = "${trainer.default_local_dir}/logs"
    """Folder for the metrics JSONL, TensorBoard events and the reward plot."""
    jsonl: bool = True
    """One JSON object per step in ``metrics.jsonl``."""
    tensorboard: bool = False
    """TensorBoard event files."""
    progress_bar: bool = True
    """A live progress bar on the console."""
    plot: bool = True
    """At the end, a PNG of reward and validation accuracy per step."""
    token_mult_prob_error_threshold: float = 1.05
    """Warn (with the worst samples) when the mean exp(|rollout - trainer log-prob|) over response tokens
    exceeds this (NeMo-RL's check; our engines should read 1.000000)."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning on the same engines (``mcore-rl sft`` and the RL run's warm start)."""

    enable: bool = False
    """Run SFT before RL in ``mcore-rl train`` (the warm start)."""
    train_files: list[str] = field(default_factory=list)
    """Labelled examples: the ``data.prompt_key`` column plus ``response_key``."""
    val_files: list[str] = II("data.val_files")  # noqa: RUF009 (an interpolation string, immutable)
    """Prompts whose greedy accuracy decides early stopping; follows ``data.val_files``."""
    response_key: str = "response"
    """Column holding the target response text (EOS is appended)."""
    total_steps: int = 1000
    """Optimizer steps at most."""
    train_batch_size: int = 64
    """Examples per step, over all data-parallel ranks."""
    micro_batch_size_per_gpu: int = 64
    """Examples per forward/backward on one data-parallel rank."""
    max_length: int | None = None
    """Longest prompt + response in tokens (None: ``data.max_prompt_length + data.max_response_length``);
    longer examples follow ``data.filter_overlong_prompts``."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimizer and schedule of the SFT stage (RL continues with ``optim``)."""
    test_freq: int = 50
    """Validate every this many steps."""
    target_val_accuracy: float | None = None
    """Stop as soon as validation accuracy reaches this (None: run ``total_steps``)."""


@dataclass
class RunConfig:
    """One run: every section. Build it with :func:`mcore_rl.config.load_config` (YAML + overrides) or
    directly from Python, then :func:`mcore_rl.config.check_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """Training layout of the actor and reference."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule of the RL stage."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference optimisation (``mcore-rl dpo``); a run is a DPO run when ``dpo.train_files`` is set."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO; used when ``algorithm.adv_estimator=gae``."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A model reward combined with the rules (``reward_model.path``)."""

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node
