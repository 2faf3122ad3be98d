"""The DPO run, SPMD: every rank runs this same driver on its data-parallel shard (launched by torchrun, or
spawned locally by :func:`mcore_rl.dpo.launch.run_dpo`).

    DPOTrainer.from_config("recipes/dpo_demo_cpu.yaml", ["trainer.total_training_steps=50"]).fit()

Data flow of one step (no rollout: the data is already the preference)::

    sampler --global pair indices--> DP shard --PreferenceBatch [2B, S]--> micro-batches of whole pairs
        reference log-probs [2m]: frozen reference model (same processes) | precomputed cache | 0 (ref-free)
        policy forward/backward (fused vocab-parallel log-probs) --> dpo_loss per pair --> optimizer step
        metrics (TRL names) summed over micro-batches and DP ranks --> rank 0: JSONL / TensorBoard / bar / PNG

``fit()``: evaluate (held-out pairs' reward accuracy, greedy exact match on ``data.test_files``) -> steps
(evaluation every ``dpo.test_freq``, a resumable checkpoint every ``trainer.save_freq``) -> evaluate -> plot
(a resumed run's earlier records read back: it covers the whole run). A finished run run again (its checkpoint
at the last step) builds, loads, trains and writes nothing, as in RL.
Checkpoints are ``<trainer.default_local_dir>/checkpoints/global_step_<N>`` (the TrainEngine's resumable
checkpoint + LR schedule + data position + ``config.yaml``; ``latest`` written last), readable by
``mcore-rl convert mcore-to-hf``. The reference is rebuilt from the same start on resume (precomputed
reference log-probs come back from their cache, keyed by the data's fingerprint and the initial model).

Why SPMD rather than Ray: DPO has no rollout/score/train phases to place; one program per rank on
megatron's schedules is the whole job, and torchrun/Slurm launch it directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.algo import DPOSettings
from mcore_rl.config import ConfigError, RunConfig, check_paths, claim_run_folders, load_config, save_config
from mcore_rl.config.fast_paths import keep_logits_setting
from mcore_rl.config.run_folder import (
    check_run_folders,
    checkpoint_name,
    checkpoint_root,
    publish_checkpoint,
    resume_checkpoint,
)
from mcore_rl.convert.export import MODEL_DIR, check_export_folder, export_hf_model
from mcore_rl.data.preference import PreferenceDataset, prepare_preference_data
from mcore_rl.data.prompts import PromptDataset
from mcore_rl.data.sampler import EpochSampler
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.dpo.greedy import GreedyScorer
from mcore_rl.dpo.loss import DPOLossSettings, PairMicroBatch
from mcore_rl.dpo.policy import DPOPolicy, PolicySpec, shard_indices
from mcore_rl.engine.checkpoint import HF_ASSETS_DIR
from mcore_rl.engine.hf.peft import ADAPTER_DIR, save_peft_adapter
from mcore_rl.engine.trainer_checkpoint import read_trainer_state
from mcore_rl.io.manifest import has_manifest, verify_manifest, write_manifest
from mcore_rl.io.side_files import copy_model_assets
from mcore_rl.logs.plots import dpo_plot
from mcore_rl.logs.run_log import RunLog
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.scoring.registry import check_scorers, row_problem
from mcore_rl.types import PromptBatch


@dataclass
class DPOData:
    """What the driver reads: preference pairs, held-out pairs and held-out prompts (with their answers)."""

    tokenizer: Tokenizer
    train: PreferenceDataset
    val: PreferenceDataset | None
    test: PromptBatch | None


def load_dpo_data(cfg: RunConfig) -> DPOData:
    check_paths(cfg)  # each missing input named as itself, before the tokenizer is read
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or "")
    keys = (cfg.dpo.chosen_key, cfg.dpo.rejected_key)

    def pairs(files: list[str]) -> PreferenceDataset:
        return PreferenceDataset.from_files(files, tokenizer, cfg.data, keys, cfg.dpo.max_length)

    test = None
    if cfg.data.test_files:  # scored by the run's rules: each row checked for them, as an RL run's
        check = functools.partial(row_problem, cfg.reward)
        prompts = PromptDataset.from_files(cfg.data.test_files, tokenizer, cfg.data, check)
        check_scorers(cfg.reward, prompts.source_origins())
        test = prompts.batch(range(len(prompts)))
    val = pairs(cfg.dpo.val_files) if cfg.dpo.val_files else None
    return DPOData(tokenizer, pairs(cfg.dpo.train_files), val, test)


TRAIN, EVAL = "train", "eval"
"""Record stages: one optimizer step; one evaluation (held-out pairs and greedy answers)."""


class DPOTrainer:
    """One rank's driver; build with :meth:`from_config`, run with :meth:`fit`, read ``records`` after."""

    def __init__(
        self, cfg: RunConfig, ctx: ParallelContext, policy: DPOPolicy | None, data: DPOData, total_steps: int
    ) -> None:
        """``policy`` is None only for a run whose checkpoint is at ``total_steps`` already (``complete``): it
        has nothing to train, so :meth:`from_config` builds no model for it."""
        self.cfg = cfg
        self.ctx = ctx
        self._policy = policy
        self.data = data
        self.total_steps = total_steps
        self.sampler = EpochSampler(
            len(data.train),
            cfg.dpo.train_batch_size,
            cfg.data.shuffle,
            cfg.data.seed,
            True,
            _fingerprint(data.train),
        )
        self._greedy: GreedyScorer | None = None
        self.reference_cache: dict[str, torch.Tensor] = {}
        self.global_step = 0
        self.records: list[dict[str, Any]] = []
        self.complete: str | None = None
        """The checkpoint to resume when it is at ``total_steps`` already: :meth:`fit` loads, trains and logs
        nothing then."""
        self.owns_world = False

    @property
    def policy(self) -> DPOPolicy:
        if self._policy is None:
            raise RuntimeError("this run is complete already: no model was built for it")
        return self._policy

    @property
    def greedy(self) -> GreedyScorer:
        if self._greedy is None:
            self._greedy = GreedyScorer(self.cfg, self.policy.engine, self.data.tokenizer)
        return self._greedy

    @classmethod
    def from_config(
        cls, config: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = ()
    ) -> DPOTrainer:
        """Collective: a trainer for a recipe path (+ ``key=value`` overrides) or a checked :class:`RunConfig`."""
        cfg = config if isinstance(config, RunConfig) else load_config(config, overrides)
        if not cfg.dpo.train_files:
            raise ConfigError("dpo.train_files is empty: a DPO run needs preference pairs (.parquet, .jsonl)")
        owns_world = not dist.is_initialized()
        ctx = ParallelContext.initialize(cfg.parallel, cfg.trainer.seed)
        try:
            with ctx.guard("preparing the run folder"):  # rank 0's refusal stops its peers, naming it
                if ctx.rank == 0:
                    check_run_folders(cfg)  # first: a refused run writes nothing, not even generated data
                    prepare_preference_data(
                        cfg.data, cfg.dpo.train_files, cfg.dpo.val_files, cfg.model.tokenizer_path
                    )
                dist.barrier()
            data = load_dpo_data(cfg)
            batches = len(data.train) // cfg.dpo.train_batch_size
            if not batches:
                raise ConfigError(
                    f"dpo.train_batch_size={cfg.dpo.train_batch_size}: more than the {len(data.train)} "
                    "usable pairs of dpo.train_files"
                )
            total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches
            trainer = cls(cfg, ctx, None, data, total)
            trainer.owns_world = owns_world
            trainer.complete = trainer.complete_checkpoint()
            if trainer.complete is None:  # a finished run run again builds, loads and writes nothing
                trainer.start()
        except BaseException:
            ctx.destroy(destroy_process_group=owns_world)
            raise
        return trainer

    def start(self) -> None:
        """Collective, once every check passed: the run folder and its ``config.yaml`` (rank 0), the policy."""
        cfg, ctx = self.cfg, self.ctx
        with ctx.guard("preparing the run folder"):
            if ctx.rank == 0:
                claim_run_folders(cfg)
                save_config(cfg, cfg.trainer.default_local_dir)
            dist.barrier()
        spec = policy_spec(cfg, self.total_steps, self.data.tokenizer.pad_token_id)
        self._policy = DPOPolicy.build(ctx, spec, initial_weights(cfg))

    # --- the run --------------------------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Run to ``total_steps`` (or stop after ``stop_after`` steps: a simulated interruption). The summary
        holds the evaluations ``before`` / ``after``, ``plot`` and ``model``, or only ``already_complete`` (the
        step) and ``checkpoint`` when the checkpoint resumed is at ``total_steps`` already, as in RL."""
        cfg, summary = self.cfg, dict[str, Any]()
        if self.complete is not None:  # nothing is loaded, trained or logged
            return {"already_complete": self.global_step, "checkpoint": self.complete}
        if cfg.dpo.precompute_ref_log_probs and not cfg.dpo.reference_free:
            self.precompute_reference()  # with the initial policy, before a checkpoint can replace it
        resumed = self.resume()
        log = RunLog(
            cfg.logging,
            self.total_steps,
            progress_stage=TRAIN,
            bar_metrics={"loss": "loss", "acc": "rewards/accuracies", "margin": "rewards/margins"},
            plot=dpo_plot,
            start_step=self.global_step,
            enabled=self.ctx.rank == 0,  # rank 0 logs: every rank holds the same global metrics
        )
        try:
            if not resumed:
                summary["before"] = self.evaluate(log)
            while self.global_step < self.total_steps and self.global_step != stop_after:
                self.global_step += 1
                metrics = self.train_step()
                if metrics is not None:
                    log.write(TRAIN, self.global_step, metrics)
                last = self.global_step == self.total_steps
                if _every(cfg.dpo.test_freq, self.global_step, last) and not last:
                    self.evaluate(log)
                if _every(cfg.trainer.save_freq, self.global_step, last):
                    self.save()
            if self.global_step == self.total_steps:
                summary["after"] = self.evaluate(log)
                summary["model"] = self.export_model()  # the HF folder <default_local_dir>/model
        finally:
            summary["plot"] = log.close()
            self.records = log.records
        return summary

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step on the next global batch of pairs (this rank's shard)."""
        mine, weights = shard_indices(
            self.sampler.next_indices(), self.ctx, self.cfg.dpo.micro_batch_size_per_gpu
        )
        return self.policy.train_step(self._micro(self.data.train, "train", mine, weights), self.global_step)

    def evaluate(self, log: RunLog) -> dict[str, float]:
        """Held-out pairs (``eval_*`` metrics) and greedy exact match on the held-out prompts."""
        metrics: dict[str, float] = {}
        if self.data.val is not None:
            mine, weights = shard_indices(
                range(len(self.data.val)), self.ctx, self.cfg.dpo.micro_batch_size_per_gpu
            )
            metrics.update(self.policy.evaluate(self._micro(self.data.val, "val", mine, weights)))
        if self.data.test is not None:
            metrics["exact_match"] = self.greedy.accuracy(self.data.test)
        log.write(EVAL, self.global_step, metrics)
        return metrics

    def _micro(
        self, dataset: PreferenceDataset, split: str, indices: list[int], weights: torch.Tensor
    ) -> list[PairMicroBatch]:
        cache = self.reference_cache.get(split)
        ref = cache[indices] if cache is not None else None
        return self.policy.micro_batches(dataset.batch(indices, self.policy.width_multiple), weights, ref)

    # --- precomputed reference log-probs --------------------------------------------------------------------
    def precompute_reference(self) -> None:
        """Collective: [pairs, 2] reference log-probs of the train and held-out pairs, from the cache file
        when its fingerprint matches the data, else computed with the (initial) policy and cached."""
        for split, dataset in (("train", self.data.train), ("val", self.data.val)):
            if dataset is None:
                continue
            path = os.path.join(self.cfg.trainer.default_local_dir, f"ref_log_probs_{split}.pt")
            fingerprint = f"{dataset.fingerprint()}:{reference_identity(self.cfg)}"
            if os.path.isfile(path):
                saved = torch.load(path, weights_only=True)
                if saved.get("fingerprint") == fingerprint:
                    self.reference_cache[split] = saved["log_probs"]
                    continue
            if self.global_step or self.resume_path() is not None:
                raise RuntimeError(
                    f"{path}: no reference log-probs for this data and initial model, and the policy has trained"
                )
            self.reference_cache[split] = self._score_with_policy(dataset)
            if self.ctx.rank == 0:
                torch.save(
                    {"fingerprint": fingerprint, "log_probs": self.reference_cache[split]}, path + ".tmp"
                )
                os.replace(path + ".tmp", path)
            dist.barrier()

    def _score_with_policy(self, dataset: PreferenceDataset, chunk_pairs: int = 4096) -> torch.Tensor:
        parts = []
        for start in range(0, len(dataset), chunk_pairs):
            chunk = list(range(start, min(start + chunk_pairs, len(dataset))))
            mine, weights = shard_indices(chunk, self.ctx, self.cfg.dpo.micro_batch_size_per_gpu)
            batch = dataset.batch(mine, self.policy.width_multiple)
            local = self.policy.sequence_log_probs(self.policy.micro_batches(batch, weights, None))
            shards = [torch.empty_like(local) for _ in range(self.ctx.dp_size)]
            dist.all_gather(shards, local, group=self.ctx.dp_group)
            parts.append(torch.cat(shards)[: len(chunk)])  # DP ranks hold consecutive slices; padding last
        return torch.cat(parts)

    # --- checkpoints ----------------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        return checkpoint_root(self.cfg)

    def save(self) -> str:
        """Collective: policy + optimizer + schedule + data position + config; ``latest`` last; keep the last K."""
        path = os.path.join(self.checkpoint_root, checkpoint_name(self.global_step))
        extra = {"sampler": self.sampler.state_dict(), "model": self.cfg.model.hf_config_dict()}
        if self.ctx.rank == 0:
            os.makedirs(self.checkpoint_root, exist_ok=True)
        dist.barrier()

        def side_files(folder: str) -> None:  # inside the staging folder: it never appears without them
            save_config(self.cfg, folder)
            copy_model_assets(*self.cfg.model.asset_folders(), os.path.join(folder, HF_ASSETS_DIR))
            write_manifest(folder)

        self.policy.save_checkpoint(path, self.global_step, extra, side_files)
        if self.ctx.rank == 0:
            publish_checkpoint(self.cfg, self.global_step)
        dist.barrier()
        return path

    def export_model(self) -> str:
        """Collective: the policy as the HF folder ``<default_local_dir>/model`` (``mcore_rl/convert/export.py``),
        converted by rank 0 from the run checkpoint of the last step when ``trainer.save_freq`` wrote one, else
        from a model checkpoint written for it and removed after."""
        cfg, rank = self.cfg, self.ctx.rank
        out = os.path.join(cfg.trainer.default_local_dir, MODEL_DIR)
        with self.ctx.guard("exporting the model"):  # rank 0's refusal stops its peers, naming it
            if rank == 0:
                check_export_folder(out)
            dist.barrier()
        checkpoint = os.path.join(self.checkpoint_root, checkpoint_name(self.global_step))
        lora = cfg.model.lora_rank > 0  # a LoRA run checkpoint holds the adapters only: save the merged model
        saved = cfg.trainer.save_freq > 0 and not lora and os.path.isdir(checkpoint)
        if lora:  # the adapter in PEFT format beside the merged model
            adapter = os.path.join(cfg.trainer.default_local_dir, ADAPTER_DIR)
            save_peft_adapter(self.policy.engine, adapter, cfg.model.path)
        if not saved:
            checkpoint = os.path.join(cfg.trainer.default_local_dir, ".model_export_checkpoint")
            self.policy.engine.save_model(checkpoint)
        with self.ctx.guard("exporting the model"):
            if rank == 0:
                try:
                    export_hf_model(checkpoint, out, cfg.model.hf_config_dict(), cfg.model.asset_folders())
                finally:
                    if not saved:
                        shutil.rmtree(checkpoint, ignore_errors=True)
            dist.barrier()
        return out

    def resume_path(self) -> str | None:
        return resume_checkpoint(self.cfg)

    def resume(self) -> bool:
        """Collective: restore the checkpoint ``trainer.resume_mode`` names; refuses a changed model or data."""
        path = self.resume_path()
        if path is None:
            return False
        self._check_resumable(path, read_trainer_state(path)[2])  # before any weight is read
        if has_manifest(path):  # every file as saved (checkpoints of earlier versions have none)
            verify_manifest(path)
        step, _ = self.policy.load_checkpoint(path)
        self.global_step = step
        return True

    def complete_checkpoint(self) -> str | None:
        """The checkpoint to resume when it is at ``total_steps`` already, read from its driver state alone and
        refused as a resume would be (a changed model or data); None: there are steps to train."""
        path = self.resume_path()
        if path is None:
            return None
        step, _, state = read_trainer_state(path)
        if step < self.total_steps:
            return None
        self._check_resumable(path, state)
        self.global_step = step
        return path

    def _check_resumable(self, path: str, state: dict[str, Any]) -> None:
        """Refuse a checkpoint saved for another model or other data (the sampler takes its data position),
        or one that is not a DPO run's, naming the file."""
        for key in ("sampler", "model"):
            if not isinstance(state.get(key), dict):
                raise ConfigError(
                    f"{path}: extra.{key} must be an object in its trainer state (not a DPO run?)"
                )
        if state["model"] != self.cfg.model.hf_config_dict():
            raise ValueError(
                f"{path}: saved for another model (model.hf_config / config.json differ); not resuming"
            )
        self.sampler.load_state_dict(state["sampler"])  # refuses other data, naming why

    def close(self) -> None:
        if self._greedy is not None:
            self._greedy.close()
        self.ctx.destroy(destroy_process_group=self.owns_world)

    def __enter__(self) -> DPOTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def policy_spec(cfg: RunConfig, total_steps: int, pad_token_id: int) -> PolicySpec:
    dpo = cfg.dpo
    settings = DPOSettings(dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.reference_free)
    arch = cfg.model.arch()
    return PolicySpec(
        arch=arch,
        optim=cfg.optim,
        total_steps=total_steps,
        loss=DPOLossSettings(settings, arch.vocab_size, dpo.sft_loss_weight),
        micro_batch_pairs=dpo.micro_batch_size_per_gpu,
        with_reference=not (dpo.reference_free or dpo.precompute_ref_log_probs),
        dtype=cfg.model.dtype,
        scaled_output_init=cfg.model.scaled_output_init,
        keep_logits_bytes=keep_logits_setting(cfg),
        lora=cfg.model.lora_spec(),
        lora_adapter_path=cfg.model.lora_adapter_path,
        recompute=cfg.model.recompute,
        pad_token_id=pad_token_id,
        on_nonfinite=cfg.trainer.on_nonfinite_loss,
    )


def initial_weights(cfg: RunConfig) -> dict[str, torch.Tensor] | None:
    """The HF weights of ``model.path`` as a full state (None: the seeded random initialisation)."""
    if cfg.model.path is None or not cfg.model.load_weights:
        return None
    if cfg.model.is_megatron_checkpoint():  # the policy and its reference start from one full HF state
        raise ConfigError(
            f"model.path {cfg.model.path}: a megatron checkpoint; DPO starts from an HF folder "
            f"(mcore-rl convert mcore-to-hf --ckpt {cfg.model.path} --out DIR, then model.path=DIR)"
        )
    from mcore_rl.engine.hf.state import load_hf_full_state

    return load_hf_full_state(cfg.model.path, cfg.model.arch())


def reference_identity(cfg: RunConfig) -> str:
    """What the cached reference log-probs depend on besides the data: the initial model. ``model.path``'s
    weight files by name, size and modification time (a different model in the same run folder, or the
    folder's weights replaced, misses the cache), else the seeded random initialisation; its dtype and
    architecture overrides either way; and the files of ``model.lora_adapter_path`` (the policy as loaded)."""
    model = cfg.model
    parts: list[Any] = [model.dtype, model.hf_config, model.scaled_output_init]
    if model.path is None or not model.load_weights:
        parts.append(("random", cfg.trainer.seed))
    else:
        parts += _folder_files(model.path)
    if model.lora_adapter_path is not None:
        parts += ["lora_adapter", *_folder_files(model.lora_adapter_path)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _folder_files(path: str) -> list[tuple[str, int, int]]:
    """(relative name, size, modification time) of every file under ``path``."""
    root, files = os.path.realpath(path), []
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            stat = os.stat(os.path.join(folder, name))
            files.append((os.path.relpath(os.path.join(folder, name), root), stat.st_size, stat.st_mtime_ns))
    return files


def _fingerprint(dataset: PreferenceDataset) -> str:
    return f"dpo:{len(dataset)}:{dataset.fingerprint()}"


def _every(freq: int, step: int, last: bool) -> bool:
    return freq > 0 and (step % freq == 0 or last)
