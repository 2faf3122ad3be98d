"""The run around the RL step: data, the SFT warm start, validation, run checkpoints and resume, logs.

    Trainer.from_config("recipes/demo_cpu.yaml", ["trainer.total_training_steps=50"]).fit()

``fit()``: held-out test (``trainer.val_before_train``) -> SFT warm start (``sft.enable``) -> held-out test ->
validation at RL step 0 (``trainer.val_before_train``) -> RL steps (validation every ``trainer.test_freq``, a run
checkpoint every ``trainer.save_freq``) -> held-out test -> reward plot.

``from_config`` refuses a run before it writes anything or starts a worker: the config's rules, where it would
write (and an earlier run's log it would replace), a tokenizer larger than the model's vocabulary, a
``data_source`` no scorer answers, a checkpoint to resume that was saved for another model or other data. Only
then are the run folder and its ``config.yaml`` written (and only inputs that ``data.generate`` finds missing
are written before those checks, as the checks read them).

A run checkpoint ``<default_local_dir>/checkpoints/global_step_<N>`` holds the actor's weights and
optimizer (the resumable TrainEngine checkpoint), the LR schedule, the driver state (step, data position), the
resolved ``config.yaml`` and a manifest; it appears complete or not at all and ``latest`` names it in the same
moment (``run_checkpoint.py``). With ``trainer.one_step_off`` it also holds the next step's prompts and the
rollout already generated for them (``pending_rollout.safetensors``; a multi-turn rollout's conversations in
``pending_turns.json``), so a resumed run trains on what the
uninterrupted one would have. Sampling seeds derive from ``(trainer.seed, step)``, so a resumed run draws what
the uninterrupted one would have.

Faults (README "Faults and recovery"): a lost worker restarts the worker groups and continues from the last
run checkpoint (``recovery.py``, ``trainer.max_restarts``); SIGTERM or SIGUSR1 during the RL steps ends the
current step, saves a run checkpoint and raises :class:`~mcore_rl.io.errors.Preempted` (``mcore-rl`` exits 75);
a save that fails follows ``trainer.on_save_failure``; a hung worker phase ends the run naming it
(``trainer.phase_timeout_s``, ``controller/watchdog.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from mcore_rl.config import (
    RunConfig,
    check_config,
    check_paths,
    claim_run_folders,
    load_config,
    save_config,
)
from mcore_rl.config.run_folder import check_run_folders, checkpoint_name, checkpoint_root
from mcore_rl.controller.backend import hand_over_ray
from mcore_rl.controller.resources import shutdown_ray
from mcore_rl.data.demo_task import prepare_data
from mcore_rl.data.prompts import PromptLoader
from mcore_rl.io.checkpoint_read import checkpoint_failure
from mcore_rl.io.errors import CheckpointSaveError, Interrupted, Preempted, note
from mcore_rl.io.signals import StopRequest, stop_requests
from mcore_rl.logs.plots import reward_plot
from mcore_rl.logs.run_log import RunLog
from mcore_rl.scoring import RewardScorer
from mcore_rl.trainer.build import build_actor_group, build_step, check_start, worker_spec
from mcore_rl.trainer.export import export_rl_model
from mcore_rl.trainer.groups.actor import ActorGroup
from mcore_rl.trainer.recovery import Recovery, is_lost_worker, kept_records
from mcore_rl.trainer.run_checkpoint import (
    ResumePoint,
    latest_checkpoint,
    load_pending,
    resume_point,
    save_failure,
    save_pending,
    staged_checkpoint,
)
from mcore_rl.trainer.run_data import RunData, data_sources, load_run_data
from mcore_rl.trainer.run_notes import fast_path_note
from mcore_rl.trainer.step import StepBase, update_plan
from mcore_rl.trainer.validation import Evaluation
from mcore_rl.types import PromptBatch


class Trainer:
    """Drives one run; build with :meth:`from_config`, run with :meth:`fit`, read ``records`` after."""

    def __init__(
        self,
        cfg: RunConfig,
        actors: ActorGroup | None,
        step: StepBase | None,
        data: RunData,
        total_steps: int,
        resume_from: ResumePoint | None = None,
        scorer: RewardScorer | None = None,
        use_ray: bool = True,
    ) -> None:
        """``actors`` and ``step`` are None only for a run whose checkpoint is at ``total_steps`` already: it has
        nothing to train, so :meth:`from_config` starts no workers for it."""
        self.cfg = cfg
        self._actors = actors
        self._step = step
        self.data = data
        self.total_steps = total_steps
        self.resume_from = resume_from
        """The checkpoint :meth:`fit` continues from (checked by :meth:`from_config`); None: a fresh run."""
        self.scorer = scorer or (step.scorer if step is not None else None)
        self.use_ray = use_ray
        self.global_step = 0
        self._prefetched: PromptBatch | None = None
        """``trainer.one_step_off``: the next step's prompts, already drawn (their rollout is pending)."""
        self._saved: str | None = None
        """The last run checkpoint this run saved (where a recovery continues from)."""
        self.records: list[dict[str, Any]] = []
        self.recoveries: list[Recovery] = []
        """Each recovery from a lost worker so far (``trainer.max_restarts``)."""
        self._staging: str | None = None
        """The staging folder of a run checkpoint being saved."""

    @property
    def actors(self) -> ActorGroup:
        if self._actors is None:
            raise RuntimeError("this run is complete already: no workers were started for it")
        return self._actors

    @property
    def step(self) -> StepBase:
        if self._step is None:
            raise RuntimeError("this run is complete already: no workers were started for it")
        return self._step

    @classmethod
    def from_config(
        cls, config: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = (), use_ray: bool = True
    ) -> Trainer:
        """A trainer for a recipe path (+ ``key=value`` overrides) or a :class:`RunConfig` (resolved and checked
        here as a recipe is); everything that can refuse the run is checked before anything is written."""
        if isinstance(config, RunConfig) and overrides:
            raise ValueError("overrides apply to a recipe path; set the fields of a RunConfig directly")
        ranks = None if use_ray else 1  # an in-process run is one rank: an automatic count stops there
        cfg = (
            check_config(config, max_ranks=ranks)
            if isinstance(config, RunConfig)
            else load_config(config, overrides, max_ranks=ranks)
        )
        check_run_folders(cfg)  # first: where it writes, before even generated data is written
        prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)
        check_paths(cfg)  # now that generated data exists: each missing input named as itself
        data = load_run_data(cfg)
        check_start(cfg, data.tokenizer, data_sources(data))
        resume_from = resume_point(cfg, data.loader)
        total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(data.loader)
        if resume_from is not None and resume_from.step >= total:
            return cls(cfg, None, None, data, total, resume_from)  # already complete: no workers, no writes
        scorer = RewardScorer(
            cfg.reward
        )  # every user scorer imported and its signature checked; no process yet
        note(fast_path_note(cfg))  # once per run: what makes its step fast, and what keeps any path off
        claim_run_folders(cfg)  # every check passed: now the run folder and its config
        save_config(cfg, cfg.trainer.default_local_dir)
        trainer = cls(cfg, None, None, data, total, resume_from, scorer, use_ray)
        try:
            trainer.start_workers()
        except BaseException:
            trainer.close()
            raise
        return trainer

    def start_workers(self, owns_ray: bool = False) -> None:
        """Start the actor's workers and the step's other groups (critic, rollout pool); ``owns_ray``: the
        local Ray they start on was started for this run by workers stopped before (a recovery)."""
        cfg = self.cfg
        spec = worker_spec(cfg, actor_optimizer_steps(cfg, self.total_steps))
        self._actors = build_actor_group(cfg, spec, self.use_ray)
        if (
            owns_ray
        ):  # the run's own local Ray, kept across the restart: stopped with these workers at the end
            hand_over_ray(self._actors.backend, True)
        assert self.scorer is not None
        self._step = build_step(cfg, self._actors, self.data.tokenizer, self.scorer, self.total_steps)
        self._step.draw_prompts = self.data.loader.next_batch  # dynamic sampling draws beyond its batch

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Run to ``total_steps`` (or stop after ``stop_after`` RL steps: a simulated interruption). The summary
        holds the held-out accuracies that ran (``test_before``, ``test_after_sft``, ``test_after_rl``: None
        without ``data.test_files``), ``sft_steps``, ``val_before``, ``resumed_from`` / ``resumed_step``, or only
        ``already_complete`` (the step) and ``checkpoint`` when the checkpoint resumed is at ``total_steps``
        already: nothing is loaded, trained or logged then. A lost worker is recovered from (``recovery.py``);
        SIGTERM / SIGUSR1 during the RL steps raise :class:`Preempted` once a checkpoint is saved."""
        cfg, summary = self.cfg, dict[str, Any]()
        point = self.resume_from
        if point is not None and point.step >= self.total_steps:
            self.global_step = point.step
            return {"already_complete": point.step, "checkpoint": point.path}
        resumed = self.resume()
        if resumed and point is not None:
            summary["resumed_from"], summary["resumed_step"] = point.path, point.step
        log = RunLog(
            cfg.logging,
            self.total_steps,
            plot=reward_plot,
            stage_steps={"sft": cfg.sft.total_steps} if cfg.sft.enable and not resumed else None,
            start_step=self.global_step,
            kept=_kept,  # a resumed run's plot: the earlier records that still stand
            samples=lambda: (
                self.step.take_val_samples()
            ),  # logging.log_val_generations; a recovery's step too
        )
        stop = StopRequest()  # one for the whole run: a recovery keeps a stop asked for before it
        try:
            while True:
                try:
                    self._stages(log, summary, resumed, stop_after, stop)
                    break
                except Exception as err:
                    if not is_lost_worker(err):
                        raise
                    if len(self.recoveries) >= cfg.trainer.max_restarts:
                        if cfg.trainer.max_restarts:
                            note(
                                f"not recovering again: {len(self.recoveries)} recoveries (trainer.max_restarts)"
                            )
                        raise
                    with stop_requests(stop):
                        resumed = self._recover(err, log)
                    if stop and resumed and self.resume_from is not None:  # stop where it resumed (saved)
                        assert stop.signum is not None
                        raise Preempted(stop.signum, self.global_step, self.resume_from.path) from None
        finally:
            summary["plot"] = log.close()
            self.records = log.records
        return summary

    def _stages(
        self, log: RunLog, summary: dict[str, Any], resumed: bool, stop_after: int | None, stop: StopRequest
    ) -> None:
        """From where the run stands: the start (unless ``resumed``), the RL steps, the end."""
        if not resumed:
            self._before_rl(log, summary)
        with stop_requests(stop):  # SIGTERM / SIGUSR1: end this step, save, stop
            while self.global_step < self.total_steps and self.global_step != stop_after:
                saved = self._rl_step(log)
                if stop and self.global_step < self.total_steps:
                    assert stop.signum is not None
                    raise Preempted(stop.signum, self.global_step, saved or self._required_save())
        if self.global_step == self.total_steps:
            summary["test_after_rl"] = self.test(log, "after_rl")
            summary["model"] = export_rl_model(self)  # the HF folder <default_local_dir>/model

    def _rl_step(self, log: RunLog) -> str | None:
        """One RL step, its validation and its checkpoint (the path, when one was saved)."""
        cfg = self.cfg
        self.global_step += 1
        prompts = self._prefetched if self._prefetched is not None else self.data.loader.next_batch()
        one_step_off = cfg.trainer.one_step_off and self.global_step < self.total_steps
        self._prefetched = self.data.loader.next_batch() if one_step_off else None
        metrics = self.step.run(prompts, self.global_step, next_prompts=self._prefetched).metrics()
        last = self.global_step == self.total_steps
        if self.data.val is not None and _every(cfg.trainer.test_freq, self.global_step, last):
            start = time.perf_counter()
            metrics.update(_val_metrics(self.step.evaluate(self.data.val)))
            metrics["time/validation_s"] = time.perf_counter() - start
        saved = None
        if _every(cfg.trainer.save_freq, self.global_step, last):  # before the record, which then times it
            start = time.perf_counter()
            saved = self.save()
            metrics["time/save_s"] = time.perf_counter() - start
        log.write("rl", self.global_step, metrics)
        return saved

    def _required_save(self) -> str:
        path = self.save(required=True)
        assert path is not None
        return path

    def _recover(self, err: Exception, log: RunLog) -> bool:
        """After a lost worker: every group stopped and started again, the last run checkpoint loaded (the
        start, without one); returns whether a checkpoint was loaded."""
        start, failed_at = time.monotonic(), self.global_step
        note(f"{err}".splitlines()[0][:300] + "; recovering")
        owns_ray = self._stop_workers()
        try:
            self.start_workers(owns_ray)
        except BaseException:
            if owns_ray:  # nothing of the run is left to stop it with
                shutdown_ray()
            raise
        self.resume_from = self._recovery_point()  # the data position comes back with it
        self._prefetched = None
        resumed = self.resume()
        if not resumed:  # nothing saved yet: the run starts over (its SFT warm start too)
            self.global_step = 0
            self.data.loader = PromptLoader(self.data.loader.dataset, self.cfg.data)
        recovery = Recovery(
            len(self.recoveries) + 1,
            getattr(err, "rank", -1),
            getattr(err, "method", "?"),
            failed_at,
            self.global_step,
            time.monotonic() - start,
        )
        self.recoveries.append(recovery)
        note(recovery.line(self.cfg.trainer.max_restarts))
        log.records[:] = kept_records(log.records, self.global_step, resumed)
        log.write("recovery", self.global_step, recovery.record())
        return resumed

    def _recovery_point(self) -> ResumePoint | None:
        """Where a recovery continues: this run's last save, else where the run started (the checkpoint
        ``trainer.resume_mode`` named, or the start). ``auto`` finds the last save through ``latest``; the
        other modes would name the start checkpoint (``resume_path``) or none (``disable``) after saves too."""
        cfg = self.cfg
        if self._saved is not None and cfg.trainer.resume_mode != "auto":
            trainer = dataclasses.replace(
                cfg.trainer, resume_mode="resume_path", resume_from_path=self._saved
            )
            cfg = dataclasses.replace(cfg, trainer=trainer)
        return resume_point(cfg, self.data.loader)

    def _before_rl(self, log: RunLog, summary: dict[str, Any]) -> None:
        """A fresh run's start: the held-out test and, after the SFT warm start, validation at RL step 0
        (``trainer.val_before_train``)."""
        cfg = self.cfg
        if cfg.trainer.val_before_train:
            summary["test_before"] = self.test(log, "before")
        if cfg.sft.enable:
            summary["sft_steps"] = self.sft(log)
            summary["test_after_sft"] = self.test(log, "after_sft")
            self.actors.set_optim(cfg.optim, actor_optimizer_steps(cfg, self.total_steps))
            self.actors.reset_reference()  # KL terms measure against where RL starts, not the pre-SFT model
            self.step.warm_started()
        if cfg.trainer.val_before_train and self.data.val is not None:
            before = self.step.evaluate(self.data.val)
            summary["val_before"] = before.accuracy
            log.write("rl", 0, _val_metrics(before))

    def test(self, log: RunLog, when: str) -> float | None:
        """Held-out accuracy (``data.test_files``) with validation sampling; logged as stage ``test``."""
        if self.data.test is None:
            return None
        result = self.step.evaluate(self.data.test)
        log.write(
            "test", self.global_step, {"when": when, "accuracy": result.accuracy, "reward": result.reward}
        )
        return result.accuracy

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
            if self.data.sft_val is not None and sft.test_freq > 0 and step % sft.test_freq == 0:
                metrics.update(_val_metrics(self.step.evaluate(self.data.sft_val)))
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

    def save(self, required: bool = False) -> str | None:
        """Actor weights + optimizer + schedule + driver state + config + manifest, published with ``latest``
        at once (``run_checkpoint.py``); older ones beyond ``trainer.max_ckpt_to_keep`` go. A save the
        filesystem refuses leaves the previous checkpoint intact and, with ``trainer.on_save_failure=continue``
        (and not ``required``: the save of a preemption), returns None after one line saying so."""
        path = os.path.join(self.checkpoint_root, checkpoint_name(self.global_step))
        state = {
            "loader": self.data.loader.state_dict(),
            "model": self.cfg.model.hf_config_dict(),
            "algorithm": self.step.state_dict(),  # e.g. the in-reward KL controller
            # one-step-off: the next step's prompts (drawn: the loader is past them) and, beside, their rollout
            "pending_prompts": None if self._prefetched is None else self._prefetched.indices.tolist(),
        }
        try:
            with staged_checkpoint(self.cfg, self.global_step, path) as staging:
                self._staging = staging
                self.actors.save_checkpoint(staging, self.global_step, state)  # in the TRAIN phase
                self.step.save_models(staging, self.global_step)  # PPO: <path>/critic
                pending = self.step.pending_rollout(self._prefetched)
                if pending is not None:
                    save_pending(staging, pending, self.step.pending_turns(self._prefetched))
                self.actors.sync_weights()  # back to ROLLOUT for the next step
                save_config(self.cfg, staging)  # inside: the folder never appears without it
        except BaseException as err:  # torch's CheckpointException is a BaseException
            interrupt = checkpoint_failure(err)  # a signal that landed inside torch's writer, as itself
            if isinstance(interrupt, (Interrupted, KeyboardInterrupt)):
                raise interrupt from None
            why = save_failure(err, self.checkpoint_root)
            if why is None:
                raise
            self.actors.sync_weights()  # the ranks are fine (they all saw the failure): back to ROLLOUT
            self._save_failed(why, required)
            return None
        self._staging = None
        self._saved = path
        return path

    def _save_failed(self, why: str, required: bool) -> None:
        previous = latest_checkpoint(self.cfg)
        intact = (
            f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        )
        line = f"step {self.global_step}: run checkpoint not saved ({why}); {intact}"
        if required or self.cfg.trainer.on_save_failure == "stop":
            hint = "" if required else " (trainer.on_save_failure=continue trains on without it)"
            raise CheckpointSaveError(line + hint)
        note(f"{line}; training on (trainer.on_save_failure=continue)")

    def resume(self) -> bool:
        """Restore :attr:`resume_from` (the data position is restored already, by its check)."""
        if self.resume_from is None:
            return False
        path, saved = self.resume_from.path, self.resume_from.state
        note(f"resuming from {path} (step {self.resume_from.step})")
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
        rollout, turns = load_pending(path, self.step.multi_turn is not None)
        self._prefetched = self.data.loader.dataset.batch(indices)
        self.step.restore_pending(self._prefetched, rollout, turns)

    def _stop_workers(self) -> bool:
        """Stop every worker group (Ray keeps running); returns whether this run had started that Ray."""
        owned = hand_over_ray(self._actors.backend, False) if self._actors is not None else False
        if self._step is not None:
            self._step.close()
        if self._actors is not None:
            self._actors.shutdown()
        self._step, self._actors = None, None
        return owned

    def close(self, graceful: bool = True) -> None:
        """Stop the scorer's processes and every worker group (``graceful``: the ranks leave their world
        first; else they are killed, e.g. on an interrupt in the middle of a phase)."""
        if self.scorer is not None:
            self.scorer.close()
        if self._step is not None:
            self._step.close()
        if self._actors is not None:
            self._actors.shutdown(graceful=graceful)
        if self._staging is not None:
            # An interrupted save: its staging folder was removed, but a rank still writing may have made it
            # again; the ranks are gone now, so what is there is only that.
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(graceful=exc[0] is None)


def actor_optimizer_steps(cfg: RunConfig, total_steps: int) -> int:
    """The actor's optimizer steps over ``total_steps`` RL steps (the end of its LR decay): none during PPO's
    critic warm-up, where the actor is frozen."""
    plan = update_plan(cfg)
    frozen = min(cfg.critic.warmup_steps, total_steps) if cfg.algorithm.adv_estimator == "gae" else 0
    return (total_steps - frozen) * plan.num_mini_batches * plan.ppo_epochs


def _kept(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """:func:`kept_records` as the run log's rule (``RunLog(kept=)``): every checkpoint is at an RL step >= 1,
    so a restart after step 0 is one from the start."""
    return kept_records(records, step, from_checkpoint=step > 0)


def _val_metrics(result: Evaluation) -> dict[str, float]:
    """A validation's record keys: the share answered right and the mean reward."""
    return {"val_accuracy": result.accuracy, "val_reward": result.reward}


def _every(freq: int, step: int, last: bool) -> bool:
    return freq > 0 and (step % freq == 0 or last)
