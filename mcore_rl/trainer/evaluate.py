"""``mcore-rl eval`` (:func:`evaluate_model`): a model's greedy and sampled answers to a prompt set, scored
by the run's rules (``trainer/validation.py``, the code of a run's validation), summed up per data_source.

    prompts --actors.generate(sampling)--> RolloutBatch [P * n rows, prompt-major] --step.score--> [P * n]
        greedy (temperature 0, n 1)           -> accuracy: the share of prompts whose answer passes
        rollout.val_kwargs (n samples, T > 0) -> mean reward, pass@k for k = 1, 2, 4, .., n (unbiased)
        per data_source and over all prompts  -> EvalReport (printed as a table, --json)

A sample *passes* when its reward reaches ``pass_threshold`` (1.0: the full score of a 0/1 rule; a wrong
answer's ``reward.format_score`` does not pass). pass@k is the unbiased estimator of Chen et al. (2021) that
verl's validation metrics use: with c of n samples passing, ``1 - C(n - c, k) / C(n, k)``, averaged over
prompts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.io.errors import note
from mcore_rl.trainer.validation import PASS_THRESHOLD, scored_parts
from mcore_rl.types import PromptBatch

if TYPE_CHECKING:
    from mcore_rl.config import RunConfig
    from mcore_rl.engine.rollout.base import SamplingParams
    from mcore_rl.trainer.step import StepBase


# --- the numbers of an evaluation ---------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` of ``n`` samples passing: ``1 - C(n-c, k) / C(n, k)``,
    computed as a product (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class SourceResult:
    """The numbers of one ``data_source`` (or of all prompts)."""

    num_prompts: int
    greedy_accuracy: float
    """Share of prompts whose greedy answer passes."""
    greedy_mean_reward: float
    """Mean reward of the greedy answers."""
    sampled_mean_reward: float | None = None
    """Mean reward over the n samples of every prompt; None without sampling."""
    pass_at: dict[int, float] = field(default_factory=dict)
    """k -> mean unbiased pass@k over the prompts (sampling only)."""


ALL = "all"
"""The row of :func:`summarize` over every prompt."""


def summarize(
    data_sources: Sequence[str],
    greedy: torch.Tensor,
    samples: torch.Tensor | None = None,
    pass_threshold: float = PASS_THRESHOLD,
) -> dict[str, SourceResult]:
    """Per ``data_source`` (sorted) and :data:`ALL`: ``greedy`` [P] rewards of the greedy answers, ``samples``
    [P, n] rewards of the n sampled answers per prompt (None: greedy only)."""
    sources = list(data_sources)
    if greedy.shape != (len(sources),) or (samples is not None and samples.shape[0] != len(sources)):
        shape = None if samples is None else list(samples.shape)
        raise ValueError(f"{len(sources)} prompts, greedy rewards {list(greedy.shape)}, samples {shape}")
    out = {}
    for name in [*sorted(set(sources)), ALL]:
        rows = torch.tensor([name in (ALL, s) for s in sources])
        g = greedy[rows].double()
        result = SourceResult(int(rows.sum()), float((g >= pass_threshold).double().mean()), float(g.mean()))
        if samples is not None:
            s = samples[rows].double()
            passed = (s >= pass_threshold).sum(dim=1).tolist()
            n = int(s.shape[1])
            pass_at = {k: sum(pass_at_k(n, int(c), k) for c in passed) / len(passed) for k in pass_ks(n)}
            result = dataclasses.replace(result, sampled_mean_reward=float(s.mean()), pass_at=pass_at)
        out[name] = result
    return out


@dataclass(frozen=True)
class EvalReport:
    """What ``mcore-rl eval`` measured."""

    model: str
    """The model folder or checkpoint evaluated."""
    data_files: list[str]
    num_samples: int
    """n: samples per prompt of the sampled pass (``rollout.val_kwargs.n``); 0 without one."""
    temperature: float
    """``rollout.val_kwargs.temperature`` of the sampled pass."""
    pass_threshold: float
    by_source: dict[str, SourceResult]
    """data_source -> its numbers, and :data:`ALL`."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "data_files": self.data_files,
            "num_samples": self.num_samples,
            "temperature": self.temperature,
            "pass_threshold": self.pass_threshold,
            "by_data_source": {
                name: {
                    **{k: v for k, v in dataclasses.asdict(r).items() if k != "pass_at"},
                    **{f"pass@{k}": v for k, v in r.pass_at.items()},
                }
                for name, r in self.by_source.items()
            },
        }

    def table(self) -> str:
        """One line per data_source and one for all prompts."""
        ks = sorted({k for r in self.by_source.values() for k in r.pass_at})
        width = max(len("data_source"), *(len(name) for name in self.by_source))
        head = f"{'data_source':<{width}}  prompts  greedy acc  greedy reward"
        head += "  sampled reward" if self.num_samples else ""
        head += "".join(f"  {f'pass@{k}':>8}" for k in ks)
        lines = [head]
        for name, r in self.by_source.items():
            line = f"{name:<{width}}  {r.num_prompts:>7}  {r.greedy_accuracy:>10.1%}  {r.greedy_mean_reward:>13.3f}"
            if r.sampled_mean_reward is not None:
                line += f"  {r.sampled_mean_reward:>14.3f}"
            line += "".join(f"  {r.pass_at[k]:>8.1%}" for k in ks)
            lines.append(line)
        return "\n".join(lines)


# --- mcore-rl eval ------------------------------------------------------------------------------------------
EVAL_KEYS = (
    "sft.enable=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "data.generate=null",
    "data.val_files=[]",
    "data.test_files=[]",
    "dpo.train_files=[]",
    "dpo.val_files=[]",
)
"""An evaluation trains nothing: what a run's recipe (or its saved config) would add beside the model and the
data is switched off."""


@dataclass(frozen=True)
class EvalSource:
    """Where an evaluation's model comes from."""

    model_path: str
    """``model.path``: an HF folder or a megatron model checkpoint (a run checkpoint is one)."""
    recipe: str | None
    """The run's saved ``config.yaml`` when the model is a run checkpoint or a run folder's ``model/`` (its
    tokenizer, lengths, sampling and layout), else None."""


def eval_source(given: str) -> EvalSource:
    """``given`` as a model: a run folder (:func:`run_folder_model`), a run checkpoint (``global_step_N``,
    with its ``config.yaml``), a megatron model checkpoint or an HF folder."""
    from mcore_rl.config.loader import CONFIG_FILE
    from mcore_rl.io.errors import InputError

    if not os.path.isdir(given):
        raise InputError(f"{given}: no such model folder or checkpoint (local folders only)")
    exported = run_folder_model(given) or run_model_folder(given)
    if exported is not None:
        return exported
    latest = os.path.join(given, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            given = os.path.join(given, "checkpoints", f.read().strip())
    saved = os.path.join(given, CONFIG_FILE)
    if os.path.isfile(saved) and os.path.isfile(os.path.join(given, "trainer_state.json")):
        return EvalSource(given, saved)
    return EvalSource(given, None)


def run_folder_model(run: str) -> EvalSource | None:
    """A run folder's ``model/`` (the HF export every finished SFT, RL or DPO run ends with) with the run's
    ``config.yaml`` as the recipe; None when ``run`` has none, or when its ``checkpoints/latest`` was written
    after it: a run resumed past its export and stopped before its new end, whose newest weights are that
    checkpoint. A finished run's last checkpoint holds the weights ``model/`` was converted from, so
    ``model/`` loses nothing; it is also a LoRA run's merged model (its run checkpoints hold the
    adapters only) and what a run with ``trainer.save_freq=-1`` (no checkpoints) leaves."""
    from mcore_rl.config.loader import CONFIG_FILE
    from mcore_rl.convert.export import MODEL_DIR

    exported, saved = os.path.join(run, MODEL_DIR), os.path.join(run, CONFIG_FILE)
    hf_config = os.path.join(exported, "config.json")
    if not (os.path.isfile(hf_config) and os.path.isfile(saved)):
        return None
    latest = os.path.join(run, "checkpoints", "latest")
    # the export follows the last checkpoint's save; a checkpoint written after it is a later step's
    if os.path.isfile(latest) and os.path.getmtime(latest) > os.path.getmtime(hf_config):
        return None
    return EvalSource(exported, saved)


def run_model_folder(given: str) -> EvalSource | None:
    """``given`` as a run folder's ``model/`` itself (``mcore-rl eval runs/rl/model``): the HF export with the
    run's ``config.yaml`` beside it as the recipe, as :func:`run_folder_model` reads the run folder; None for
    any other folder (one not named ``model/``, or with no run config next to it)."""
    from mcore_rl.config.loader import CONFIG_FILE
    from mcore_rl.convert.export import MODEL_DIR

    folder = os.path.normpath(given)
    saved = os.path.join(os.path.dirname(folder) or os.curdir, CONFIG_FILE)
    is_export = os.path.basename(folder) == MODEL_DIR and os.path.isfile(os.path.join(given, "config.json"))
    return EvalSource(given, saved) if is_export and os.path.isfile(saved) else None


def eval_config(
    model: str,
    data_files: Sequence[str],
    overrides: Sequence[str] = (),
    recipe: str | None = None,
    max_ranks: int | None = None,
) -> RunConfig:
    """The run config of an evaluation: ``recipe`` (else a run checkpoint's saved config, else the schema
    defaults), training switched off (:data:`EVAL_KEYS`), the model and data, then ``overrides``;
    ``max_ranks`` as :func:`~mcore_rl.config.load_config`'s (1 in this process)."""
    from mcore_rl.config import ConfigError, load_config

    source = eval_source(model)
    base = recipe or source.recipe
    # A run's saved model.tokenizer_path is as written where the run started (often relative): the model
    # evaluated carries its own tokenizer files, read wherever eval runs (an override still wins).
    from mcore_rl.config.model import shipped_tokenizer

    tokenizer = shipped_tokenizer(source.model_path) if recipe is None and source.recipe else None
    keys = [
        *EVAL_KEYS,
        f"model.path={yaml_str(source.model_path)}",
        *([f"model.tokenizer_path={yaml_str(tokenizer)}"] if tokenizer is not None else []),
        f"data.train_files=[{','.join(yaml_str(f) for f in data_files)}]",
        *overrides,
    ]
    if base is not None:
        return load_config(base, keys, max_ranks=max_ranks)
    try:
        return load_config(None, keys, max_ranks=max_ranks)
    except ConfigError as err:  # e.g. the base lengths exceed a small model's max_position_embeddings
        raise ConfigError(
            f"{err} (eval read the schema's defaults: pass the recipe the model was trained with, "
            "--recipe RECIPE, or set the keys named, e.g. data.max_response_length=N)"
        ) from None


def yaml_str(path: str) -> str:
    """``path`` as one quoted YAML string of an override's value: unquoted, a ``,`` split a flow list in two,
    ``#`` started a comment, ``: `` made a mapping and ``123`` or ``null`` were not strings. JSON's double
    quotes are YAML's; ``${`` is escaped so that OmegaConf does not read an interpolation."""
    return json.dumps(path.replace("${", "\\${"))


def evaluate_model(
    model: str,
    data_files: Sequence[str],
    overrides: Sequence[str] = (),
    *,
    recipe: str | None = None,
    use_ray: bool = True,
    pass_threshold: float = PASS_THRESHOLD,
) -> EvalReport:
    """Greedy accuracy, sampled mean reward and pass@k of ``model`` on ``data_files`` (see the module
    docstring), on the layout and rollout engine the config names."""
    from mcore_rl.data.prompts import PromptDataset
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.scoring import RewardScorer
    from mcore_rl.scoring.registry import check_scorers
    from mcore_rl.trainer.build import build_actor_group, check_vocab, row_checks, worker_spec
    from mcore_rl.trainer.multi_turn import check_multi_turn, prompt_tokenizer
    from mcore_rl.trainer.step import StepBase

    cfg = _checked_config(model, data_files, overrides, recipe, use_ray)
    val = cfg.rollout.val_kwargs
    # multi-turn tools are listed in every prompt (rollout.multi_turn.tools_in_prompt)
    tokenizer = prompt_tokenizer(cfg, load_tokenizer(cfg.model.tokenizer_path or ""))
    # refused before the ranks start, as a run's: a tokenizer past the model's vocabulary, tools, parser or a
    # template a multi-turn rollout cannot use, a data_source no rule scores (every answer 0)
    check_vocab(cfg, tokenizer)
    check_multi_turn(cfg, tokenizer)
    dataset = PromptDataset.from_files(list(data_files), tokenizer, cfg.data, row_checks(cfg))
    check_scorers(cfg.reward, dataset.source_origins())
    # The ranks' console output into a folder of the eval's own, not the log folder of the run that made the
    # model (or ./checkpoints from the schema's default): kept and named only when the eval fails.
    cfg.logging.log_dir = tempfile.mkdtemp(prefix="mcore-rl-eval-")
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=1), use_ray)
    scorer = RewardScorer(cfg.reward)
    finished, step = False, None
    try:
        step = StepBase(cfg, actors, tokenizer, scorer)
        prompts, size = dataset.batch(range(len(dataset))), cfg.data.val_batch_size
        sampled = val.n > 1 or val.temperature > 0
        greedy = _scores(step, prompts, size, _greedy(step.sampling(0, validation=True)), 1)
        samples = _scores(step, prompts, size, step.sampling(0, validation=True), val.n) if sampled else None
        finished = True
    finally:
        scorer.close()
        if step is not None:
            step.close()  # multi-turn rollouts: their tool workers
        actors.shutdown()
        if finished:
            shutil.rmtree(cfg.logging.log_dir, ignore_errors=True)
        else:
            note(f"the ranks' output of this eval: {cfg.logging.log_dir}/workers")
    return EvalReport(
        model=model,
        data_files=list(data_files),
        num_samples=val.n if sampled else 0,
        temperature=val.temperature,
        pass_threshold=pass_threshold,
        by_source=summarize(prompts.data_sources, greedy[:, 0], samples, pass_threshold),
    )


def _checked_config(
    model: str, data_files: Sequence[str], overrides: Sequence[str], recipe: str | None, use_ray: bool
) -> Any:
    """The eval's config, refused with one line naming the field where it cannot run."""
    from mcore_rl.config import ConfigError, check_paths
    from mcore_rl.io.errors import InputError

    if not data_files:
        raise ConfigError("eval: give at least one data file (.parquet or .jsonl, verl's columns)")
    cfg = eval_config(model, data_files, overrides, recipe, max_ranks=None if use_ray else 1)
    val = cfg.rollout.val_kwargs
    if val.n > 1 and val.temperature == 0:
        raise ConfigError(
            f"rollout.val_kwargs.n={val.n} with rollout.val_kwargs.temperature=0 draws the greedy answer "
            f"{val.n} times; set a temperature (e.g. rollout.val_kwargs.temperature=1.0) for pass@k"
        )
    # DATA named as typed, not as the data.train_files it is passed as; a folder is not "missing"
    bad = [
        f"DATA {f} {'is a folder, not a data file' if os.path.isdir(f) else 'does not exist'}"
        for f in data_files
        if not os.path.isfile(f)
    ]
    if bad:
        raise InputError("; ".join(bad))
    check_paths(cfg)  # a missing model or data file named as itself, not as a tokenizer error
    return cfg


def _greedy(sampling: SamplingParams) -> SamplingParams:
    return dataclasses.replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, n=1)


def _scores(
    step: StepBase, prompts: PromptBatch, size: int | None, sampling: SamplingParams, n: int
) -> torch.Tensor:
    """[P, n] rewards of every prompt's n answers, prompts in dataset order (``size`` per generate call,
    each its own seed)."""
    parts = []
    for part, scored in scored_parts(step, prompts, size, sampling):
        order = torch.argsort(scored.rollout.prompt_index, stable=True)
        parts.append(scored.scores[order].view(len(part), n))
    return torch.cat(parts)


def write_report(report: EvalReport, path: str) -> None:
    """``--json PATH``: the report as JSON; an existing file is left as it is (refused)."""
    from mcore_rl.io.errors import OutputError

    try:
        with open(path, "x") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
    except FileExistsError:
        raise OutputError(f"--json {path} exists; it is left as it is (choose another path)") from None
