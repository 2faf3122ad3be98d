"""Schema sections of the run itself (``trainer``, ``sft``) and :class:`RunConfig`, the root that composes every
section (see :mod:`mcore_rl.config` for the whole tree): ``data`` (:mod:`mcore_rl.data.config`), ``reward``
(:mod:`mcore_rl.scoring.config`) and ``logging`` (:mod:`mcore_rl.logs.config`) live with their components."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from omegaconf import II

from mcore_rl.config.algorithm import AlgorithmConfig
from mcore_rl.config.critic import CriticConfig
from mcore_rl.config.dpo import DPOConfig
from mcore_rl.config.model import ActorConfig, ModelConfig, RolloutConfig
from mcore_rl.config.reward_model import RewardModelConfig
from mcore_rl.data.config import DataConfig
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.io.errors import ConfigError
from mcore_rl.io.fields import (
    FREQUENCY,
    NON_NEGATIVE,
    OPTIONAL_NON_NEGATIVE,
    OPTIONAL_POSITIVE,
    POSITIVE,
    Rule,
    check_section,
    choice,
)
from mcore_rl.logs.config import LoggingConfig
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.scoring.config import RewardConfig


class ResumeMode(str, Enum):
    """``trainer.resume_mode``: which run checkpoint a run continues from."""

    AUTO = "auto"
    """The latest checkpoint in ``trainer.default_local_dir`` when there is one."""
    DISABLE = "disable"
    RESUME_PATH = "resume_path"
    """``trainer.resume_from_path``."""


class Device(str, Enum):
    """``trainer.device``."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class OnNonFiniteLoss(str, Enum):
    """``trainer.on_nonfinite_loss``: what a NaN/inf loss does (the update is never applied)."""

    STOP = "stop"
    """End the run naming the step."""
    SKIP = "skip"
    """Skip that optimizer step, count it (``num_skipped``) and go on."""


class OnSaveFailure(str, Enum):
    """``trainer.on_save_failure``: what a run checkpoint that cannot be written (disk full, no permission)
    does; the previous checkpoint is left intact either way."""

    STOP = "stop"
    """End the run (exit 1), naming the error and the checkpoint that is still intact."""
    CONTINUE = "continue"
    """Warn in one line and train on; the next save tries again."""


@dataclass
class TrainerConfig:
    """The run: length, schedule of validation and checkpoints, placement (verl's ``trainer`` keys)."""

    SECTION: ClassVar[str] = "trainer"

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
    resume_mode: str = ResumeMode.AUTO.value
    """auto (the latest checkpoint in ``default_local_dir`` when there is one), disable, or resume_path
    (``resume_from_path``)."""
    resume_from_path: str | None = None
    """Checkpoint folder to resume from with ``resume_mode=resume_path``."""
    max_ckpt_to_keep: int | None = None
    """Keep the last K checkpoints; None keeps all. Older ones are removed only after a newer one is complete
    (and only folders we wrote)."""
    on_save_failure: str = OnSaveFailure.STOP.value
    """A run checkpoint that cannot be written (disk full, no permission): stop (exit 1) or continue (one
    warning line, the next save tries again); its partial folder is removed and the previous checkpoint and
    ``latest`` stay as they were either way."""
    max_restarts: int = 3
    """Recoveries from a lost worker (a rank's process killed: OOM, SIGKILL, a node that left): the driver
    stops the worker groups, starts them again on the resources Ray has, loads the last run checkpoint and
    continues (from the start when none was saved yet), at most this many times in a run; 0 ends the run at
    the first loss, naming the rank. An error a worker raises (a bug, bad input, a NaN loss) is never retried."""
    phase_timeout_s: float | None = 1800.0
    """A phase of the Ray workers (a call on every rank: generate, log-probs, update, weight sync, a
    checkpoint, and any collective inside them) that has not finished after this many seconds is a hang:
    every rank still in it writes its Python stack to ``<logging.log_dir>/stacks/`` and the run ends naming
    the phase and those ranks. Set it above the slowest phase the run can have; null waits forever (then the
    process group's own timeout decides). Worker start-up and model building are not phases. The workers'
    collective timeout (``parallel.timeout_minutes``) is raised past it when lower, so the watchdog names a hung
    collective first."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Run output folder: checkpoints, logs and the resolved ``config.yaml``."""
    seed: int = 1
    """Seed of model init, data order and sampling."""
    nnodes: int = 1
    """Nodes in the run."""
    n_gpus_per_node: int | None = None
    """Ranks per node: GPUs, or worker processes on CPU. World size = nnodes * n_gpus_per_node. None (auto,
    torchrun's ``--nproc-per-node=auto``): the ranks torchrun started, else every GPU, else on CPU one
    single-threaded rank per vCPU, as many as the layout, the batch sizes and (CPU) the host's memory allow
    (``config/machine.py``); ``mcore-rl config show`` prints the count."""
    device: str = Device.AUTO.value
    """auto (cuda when available), cuda or cpu."""
    ray_address: str | None = None
    """An existing Ray cluster (``ray start``) to join; None starts a local one."""
    num_cpus: int | None = None
    """CPUs for a local Ray; None takes them from the environment (Slurm / cgroup), never a guess."""
    host_cache_gib: float | None = None
    """CPU ranks: freed tensor memory (blocks of 1 MiB and up) each rank keeps for the next step to reuse
    instead of faulting fresh pages in (``engine/workers/host_heap.py``), at most this many GiB per rank;
    None: a quarter of the host's memory (or its cgroup's limit) shared by the ranks on it; 0: glibc's own
    behaviour (blocks above 32 MiB are unmapped when freed and faulted in again). GPU ranks ignore it."""
    on_nonfinite_loss: str = OnNonFiniteLoss.STOP.value
    """A NaN/inf loss or grad norm: stop (no update is written, the step is named) or skip the update."""
    overlap_stages: bool = True
    """PPO: after each rollout, start scoring, critic values and actor/reference log-probs together (they
    depend only on the rollout), and then the critic's and the actor's updates together (they read the same
    batch); False runs them one after another (a timing baseline: same numbers)."""
    balance_batch: bool = True
    """Deal each actor mini-batch's prompt groups (``rollout.n`` samples each, kept together for shared-prompt
    packing) to the data-parallel ranks by tokens, greedy longest-first with equal counts (verl's
    ``balance_batch``), instead of in batch order, so that no rank waits for a longer-answering one at the
    gradient sum. Each optimizer step sees the same rows, so the update is the same up to the order of float
    sums. Off where a rank's share of a mini-batch is not whole groups (the start-up note says so); with
    ``algorithm.ppo_max_token_len_per_gpu`` rows are balanced one by one instead."""
    one_step_off: bool = False
    """Generate the next step's rollout before this step's update, with the weights the update starts from
    (verl's one-step-off data flow: a policy lag of 1, logged as ``policy_lag``). The PPO ratio's old
    log-probs are recomputed by the current actor, so clipping is centred on the policy being updated, and the
    policy gradient is importance-weighted from the rollout policy to that one
    (``algorithm.rollout_is_threshold``); the mismatch shows in ``token_mult_prob_error``. Colocated rollout
    engines (``rollout.colocate``) run the two one after the other; a rollout pool of its own generates while
    the actor updates. Run checkpoints hold the pending rollout, so a resumed run continues exactly. False:
    on-policy."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "total_epochs": POSITIVE,
                "total_training_steps": OPTIONAL_POSITIVE,
                "test_freq": FREQUENCY,
                "save_freq": FREQUENCY,
                "resume_mode": choice(ResumeMode),
                "max_ckpt_to_keep": OPTIONAL_POSITIVE,
                "nnodes": POSITIVE,
                "n_gpus_per_node": OPTIONAL_POSITIVE,
                "device": choice(Device),
                "num_cpus": OPTIONAL_POSITIVE,
                "host_cache_gib": OPTIONAL_NON_NEGATIVE,
                "on_nonfinite_loss": choice(OnNonFiniteLoss),
                "on_save_failure": choice(OnSaveFailure),
                "max_restarts": NON_NEGATIVE,
                "phase_timeout_s": OPTIONAL_POSITIVE,
            },
        )


@dataclass
class SFTConfig:
    """Supervised fine-tuning on the same engines (``mcore-rl sft`` and the RL run's warm start)."""

    SECTION: ClassVar[str] = "sft"

    enable: bool = False
    """Run SFT before RL in ``mcore-rl train`` (the warm start)."""
    train_files: list[str] = field(default_factory=list)
    """Labelled examples: the ``data.prompt_key`` column plus ``response_key``, or a ``messages_key`` chat."""
    val_files: list[str] = II("data.val_files")  # noqa: RUF009 (an interpolation string, immutable)
    """Prompts whose greedy accuracy decides early stopping; follows ``data.val_files``."""
    response_key: str = "response"
    """Column holding the target response text (EOS is appended), or a list of chat turns after the prompt (a
    multi-turn trace: its assistant turns are the targets)."""
    messages_key: str = "messages"
    """Column holding a whole chat instead, a list of ``{role, content}`` turns (verl multi-turn SFT's, TRL's and
    NeMo-RL's ``messages``), read in rows without ``data.prompt_key`` + ``response_key``: the turns before the
    first assistant turn (a user turn among them) are the prompt, the rest a multi-turn trace whose assistant
    turns are the targets. A row holding both layouts is read as prompt + response."""
    total_steps: int = 1000
    """Optimizer steps at most."""
    train_batch_size: int = 64
    """Examples per step, over all data-parallel ranks."""
    micro_batch_size_per_gpu: int = 64
    """Examples per forward/backward on one data-parallel rank."""
    max_length: int | None = None
    """Longest prompt + response in tokens (None: ``data.max_prompt_length + data.max_response_length``);
    longer examples follow ``data.filter_overlong_prompts``."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, use_distributed_optimizer=None))
    """Optimizer and schedule of the SFT stage (RL continues with ``optim``)."""
    test_freq: int = 50
    """Validate every this many steps."""
    target_val_accuracy: float | None = None
    """Stop as soon as validation accuracy reaches this (None: run ``total_steps``)."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "total_steps": POSITIVE,
                "train_batch_size": POSITIVE,
                "micro_batch_size_per_gpu": POSITIVE,
                "max_length": OPTIONAL_POSITIVE,
                "test_freq": POSITIVE,
                "target_val_accuracy": Rule("in (0, 1] or null", lambda v: v is None or 0 < v <= 1),
            },
        )


@dataclass
class RunConfig:
    """One run: every section. Build it with :func:`mcore_rl.config.load_config` (YAML + overrides) or
    directly from Python, then :func:`mcore_rl.config.check_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy's training pass (mixture-of-experts router replay)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Training layout of the actor and reference."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(use_distributed_optimizer=None))
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
        if self.trainer.n_gpus_per_node is None:
            raise ConfigError(
                "trainer.n_gpus_per_node=null (auto) is resolved when the config is checked: load it with "
                "load_config or pass it through check_config first"
            )
        return self.trainer.nnodes * self.trainer.n_gpus_per_node
