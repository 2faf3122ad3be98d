"""The run around the RL step: data, the SFT warm start, validation, run checkpoints and resume, logs.

    Trainer.from_config("recipes/demo_cpu.yaml", ["trainer.total_training_steps=50"]).fit()

``fit()``: held-out test -> SFT warm start (``sft.enable``) -> held-out test -> RL steps (validation every
``trainer.test_freq``, a run checkpoint every ``trainer.save_freq``) -> held-out test -> reward plot.

A run checkpoint ``<default_local_dir>/checkpoints/global_step_<N>`` holds the actor's weights and
optimizer (the resumable TrainEngine checkpoint, written to a staging name and renamed when complete), the
LR schedule, the driver state (step, data position) and the resolved ``config.yaml``; ``latest`` is
updated last. With ``trainer.one_step_off`` it also holds the next step's prompts and the rollout already
generated for them (``pending_rollout.safetensors``), so a resumed run trains on what the uninterrupted one
would have. Sampling seeds derive from ``(trainer.seed, step)``, so a resumed run draws what the
uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load_file, save_file

from mcore_rl.config import RunConfig, claim_run_folders, load_config, save_config
from mcore_rl.config.run_folder import checkpoint_name, checkpoint_root, publish_checkpoint, resume_checkpoint
from mcore_rl.data.demo_task import prepare_data
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.io.inputs import input_file
from mcore_rl.logs.plots import reward_plot
from mcore_rl.logs.run_log import RunLog
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, build_step, worker_spec
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.trainer.step import StepBase, update_plan
from mcore_rl.types import PromptBatch, RolloutBatch

PENDING_ROLLOUT_FILE = "pending_rollout.safetensors"


@dataclass
class RunData:
    """Everything the driver reads: prompts (the answers stay here, with the scorer)."""

    tokenizer: Tokenizer
    loader: PromptLoader
    val: PromptBatch | None
    test: PromptBatch | None
    sft: SFTDataset | None


def load_run_data(cfg: RunConfig) -> RunData:
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or "")
    train = PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data)

    def whole(files: list[str]) -> PromptBatch | None:
        if not files:
            return None
        dataset = PromptDataset.from_files(files, tokenizer, cfg.data)
        return dataset.batch(range(len(dataset)))

    sft = (
        SFTDataset.from_files(
            cfg.sft.train_files, tokenizer, cfg.data, cfg.sft.response_key, cfg.sft.max_length
        )
        if cfg.sft.enable
        else None
    )
    return RunData(
        tokenizer, PromptLoader(train, cfg.data), whole(cfg.data.val_files), whole(cfg.data.test_files), sft
    )


class Trainer:
    """Drives one run; build with :meth:`from_config`, run with :meth:`fit`, read ``records`` after."""

    def __init__(
        self, cfg: RunConfig, actors: ActorGroup, step: StepBase, data: RunData, total_steps: int
    ) -> None:
        self.cfg = cfg
        self.actors = actors
        self.step = step
        self.data = data
        self.total_steps = total_steps
        self.global_step = 0
        self._prefetched: PromptBatch | None = None
        """``trainer.one_step_off``: the next step's prompts, already drawn (their rollout is pending)."""
        self.records: list[dict[str, Any]] = []

    @classmethod
    def from_config(
        cls, config: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = (), use_ray: bool = True
    ) -> Trainer:
        """A trainer for a recipe path (+ ``key=value`` overrides) or a checked :class:`RunConfig`."""
        if isinstance(config, RunConfig) and overrides:
            raise ValueError("overrides apply to a recipe path; set the fields of a RunConfig directly")
        cfg = config if isinstance(config, RunConfig) else load_config(config, overrides)
        claim_run_folders(cfg)  # first: a refused run writes nothing, not even generated data
        prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)
        save_config(cfg, cfg.trainer.default_local_dir)
        data = load_run_data(cfg)
        total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(data.loader)
        actors = build_actor_group(cfg, worker_spec(cfg, actor_optimizer_steps(cfg, total)), use_ray)
        step = build_step(cfg, actors, data.tokenizer, RewardScorer(cfg.reward), total)
        return cls(cfg, actors, step, data, total)

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Run to ``total_steps`` (or stop after ``stop_after`` RL steps: a simulated interruption)."""
        cfg, summary = self.cfg, dict[str, Any]()
        resumed = self.resume()
        log = RunLog(cfg.logging, self.total_steps, plot=reward_plot, start_step=self.global_step)
        try:
            if not resumed:
                summary["test_before"] = self.test(log, "before")
                if cfg.sft.enable:
                    summary["sft_steps"] = self.sft(log)
                    summary["test_after_sft"] = self.test(log, "after_sft")
                    self.actors.set_optim(cfg.optim, actor_optimizer_steps(cfg, self.total_steps))
                    self.step.warm_started()
            while self.global_step < self.total_steps and self.global_step != stop_after:
                self.global_step += 1
                prompts = self._prefetched if self._prefetched is not None else self.data.loader.next_batch()
                one_step_off = cfg.trainer.one_step_off and self.global_step < self.total_steps
                self._prefetched = self.data.loader.next_batch() if one_step_off else None
                metrics = self.step.run(prompts, self.global_step, next_prompts=self._prefetched).metrics()
                last = self.global_step == self.total_steps
                if self.data.val is not None and _every(cfg.trainer.test_freq, self.global_step, last):
                    metrics["val_accuracy"] = self.step.evaluate(self.data.val)
                log.write("rl", self.global_step, metrics)
                if _every(cfg.trainer.save_freq, self.global_step, last):
                    self.save()
            if self.global_step == self.total_steps:
                summary["test_after_rl"] = self.test(log, "after_rl")
        finally:
            summary["plot"] = log.close()
            self.records = log.records
        return summary

    def test(self, log: RunLog, when: str) -> float | None:
        """Held-out accuracy (``data.test_files``) with validation sampling; logged as stage ``test``."""
        if self.data.test is None:
            return None
        accuracy = self.step.evaluate(self.data.test)
        log.write("test", self.global_step, {"when": when, "accuracy": accuracy})
        return accuracy

    def sft(self, log: RunLog) -> int:
        """Supervised warm start until ``sft.target_val_accuracy`` (checked every ``sft.test_freq``)."""
        sft, dataset = self.cfg.sft, self.data.sft
        assert dataset is not None
        sampler = dataset.sampler(sft.train_batch_size, self.cfg.trainer.seed)
        self.actors.set_optim(sft.optim, sft.total_steps)
        step = 0
        for step in range(1, sft.total_steps + 1):
            metrics: dict[str, Any] = self.actors.sft_update(
                dataset.batch(sampler.next_indices()), sft.micro_batch_size_per_gpu
            )
            if self.data.val is not None and sft.test_freq > 0 and step % sft.test_freq == 0:
                metrics["val_accuracy"] = self.step.evaluate(self.data.val)
            log.write("sft", step, metrics)
            target = sft.target_val_accuracy
            if target is not None and metrics.get("val_accuracy", -1.0) >= target:
                break
        # The SFT weights into the rollout engines (colocated or a pool): RL's first step generates from them
        # even when no validation or test set has synced them (found by a run with neither).
        self.step.rollout.sync()
        return step

    # --- run checkpoints ------------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        return checkpoint_root(self.cfg)

    def save(self) -> str:
        """Actor weights + optimizer + schedule + driver state + config; ``latest`` last; keep the last K."""
        path = os.path.join(self.checkpoint_root, checkpoint_name(self.global_step))
        os.makedirs(self.checkpoint_root, exist_ok=True)
        state = {
            "loader": self.data.loader.state_dict(),
            "model": self.cfg.model.hf_config_dict(),
            "algorithm": self.step.state_dict(),  # e.g. the in-reward KL controller
            # one-step-off: the next step's prompts (drawn: the loader is past them) and, beside, their rollout
            "pending_prompts": None if self._prefetched is None else self._prefetched.indices.tolist(),
        }
        self.actors.save_checkpoint(
            path, self.global_step, state
        )  # in the TRAIN phase (optimizer state home)
        self.step.save_models(path, self.global_step)  # PPO: <path>/critic
        pending = self.step.pending_rollout(self._prefetched)
        if pending is not None:
            save_file(dataclasses.asdict(pending), os.path.join(path, PENDING_ROLLOUT_FILE))
        self.actors.sync_weights()  # back to ROLLOUT for the next step
        save_config(self.cfg, path)
        publish_checkpoint(self.cfg, self.global_step)
        return path

    def resume(self) -> bool:
        """Restore the checkpoint ``trainer.resume_mode`` names; refuses a changed model or dataset."""
        path = resume_checkpoint(self.cfg)
        if path is None:
            return False
        from mcore_rl.engine.trainer_checkpoint import read_trainer_state

        _, _, saved = read_trainer_state(path)
        model = self.cfg.model.hf_config_dict()
        changed = sorted(k for k in {**saved["model"], **model} if saved["model"].get(k) != model.get(k))
        if changed:
            raise ValueError(
                f"{path}: saved for another model (config.json differs in {changed}); not resuming"
            )
        self.data.loader.load_state_dict(saved["loader"])  # refuses a different dataset, naming why
        step, extra = self.actors.load_checkpoint(path)
        self.step.load_state_dict(extra.get("algorithm", {}))
        self.step.load_models(path)
        self._restore_pending(path, saved.get("pending_prompts"))
        self.global_step = step
        self.actors.sync_weights()
        self.step.rollout.sync()  # the checkpoint's weights to a pool too (the colocated engines have them)
        return True

    def _restore_pending(self, path: str, indices: list[int] | None) -> None:
        """One-step-off: the saved next prompts and the rollout generated for them before the interruption, so
        the resumed run trains on exactly what the uninterrupted one would have (safetensors: data only)."""
        if indices is None:
            return
        rollout_file = input_file(path, PENDING_ROLLOUT_FILE, required=False)  # a link out of it is refused
        if rollout_file is None:
            raise ValueError(
                f"{path}: the checkpoint names pending prompts but has no {PENDING_ROLLOUT_FILE}"
            )
        self._prefetched = self.data.loader.dataset.batch(indices)
        self.step.restore_pending(self._prefetched, RolloutBatch(**load_file(rollout_file)))

    def close(self) -> None:
        self.step.scorer.close()
        self.step.close()
        self.actors.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def actor_optimizer_steps(cfg: RunConfig, total_steps: int) -> int:
    """The actor's optimizer steps over ``total_steps`` RL steps (the end of its LR decay): none during PPO's
    critic warm-up, where the actor is frozen."""
    plan = update_plan(cfg)
    frozen = min(cfg.critic.warmup_steps, total_steps) if cfg.algorithm.adv_estimator == "gae" else 0
    return (total_steps - frozen) * plan.num_mini_batches * plan.ppo_epochs


def _every(freq: int, step: int, last: bool) -> bool:
    return freq > 0 and (step % freq == 0 or last)
