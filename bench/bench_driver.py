"""Ray overhead of the RL step: the same GRPO step through the driver and a Ray worker group vs in-process,
and (``--baseline trl``) against TRL's step in the same rounds.

Both paths run the identical step (``GRPOStep.run``: generate -> score || actor/reference log-probs ->
advantages -> PPO update -> weight sync) with the same worker code, seeds and weights; only where the
worker lives differs: inside the driver process (in-process backend) or in a Ray actor (world size 1),
reached through ``ray.put`` shards and object refs. Each path's driver has what a real run's has: the
in-process rank computes on the driver's torch threads, a Ray driver keeps one. Workload: Llama hidden 256,
4 layers, 8 heads, intermediate 688, vocab 1000, fp32; 8 prompts x 4 samples x 32 new tokens; 2 torch
threads per worker; and the demo's own step (``recipes/demo_cpu.yaml`` unchanged but for where its data is
written).

Steps rotate between the paths (in-process, Ray, TRL, then Ray, TRL, in-process, ...) so that load from
other processes on the machine hits all alike; the median step of each is compared. Also printed: the
control-call round trip (a no-op method on the worker) and the object-store round trip of one rollout
batch, i.e. Ray's fixed costs apart.

``--baseline trl`` adds TRL 1.16's ``GRPOTrainer`` step (``bench/bench_grpo_step.py``'s subprocess, the
``--trl-python`` interpreter) on the llama workload, which then runs as that bench times ours: no reference
pass (TRL's ``beta=0``) and each prompt once per group (``model.share_prompt_prefix=true``). Issue 17's
figure through the driver is ``--paths ray --baseline trl``: our step through Ray against TRL's, without a
third model copy in the rotation (the in-process rank's would share the caches with both).

    python -m bench.bench_driver [--steps 6] [--warmup 2] [--threads 2] [--workload llama|demo|both]
        [--override model.share_prompt_prefix=true ...] [--baseline trl] [--paths ray [ray-vllm]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_LEN = 8, 4, 32, 16
PATHS = ("in-process", "ray", "ray-vllm")
"""in-process: the rank in the driver's process; ray: a Ray worker; ray-vllm: a Ray worker with vLLM as its
rollout engine (``rollout.name=vllm``; the others run the embedded engine)."""
DEFAULT_PATHS = ("in-process", "ray")


def even_first_word(data_source: str, solution_str: str, ground_truth: object, extra_info: object) -> float:
    """The bench's rule reward: 1 when the response's first word has an even id (about half the samples)."""
    words = solution_str.split()
    return float(bool(words) and int(words[0][1:]) % 2 == 0)


def write_tokenizer(folder: str) -> None:
    """A 1000-word WordLevel tokenizer (``w0`` .. ``w999``; ``w0`` is EOS and padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["w0"])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    from mcore_rl.data.tokenizer import write_tokenizer_config

    write_tokenizer_config(folder, eos_token="w0", pad_token="w0")


def run_config(folder: str, threads: int, extra: list[str]):  # -> RunConfig
    from omegaconf import OmegaConf

    from mcore_rl.config import RunConfig, check_config

    overrides = [
        f"model.tokenizer_path={folder}",
        f"data.train_files=[{os.path.join(folder, 'train.jsonl')}]",
        f"data.max_prompt_length={PROMPT_LEN}",
        "data.apply_chat_template=false",
        "data.shuffle=false",
        f"data.train_batch_size={PROMPTS}",
        f"data.max_response_length={NEW_TOKENS}",
        f"rollout.n={SAMPLES}",
        f"algorithm.ppo_micro_batch_size_per_gpu={PROMPTS * SAMPLES}",
        "algorithm.use_kl_loss=true",  # the reference log-prob pass is part of the step
        "optim.lr=1e-5",
        f"reward.custom_function={os.path.abspath(__file__)}:even_first_word",
        f"trainer.num_cpus={threads}",
        f"trainer.default_local_dir={os.path.join(folder, 'run')}",  # worker logs there, not under the cwd
        *extra,
    ]
    node = OmegaConf.merge(OmegaConf.structured(RunConfig), {"model": {"hf_config": HF_CONFIG}})
    return check_config(OmegaConf.merge(node, OmegaConf.from_dotlist(overrides)))


def write_prompts(folder: str, num: int) -> None:
    """``num`` prompts of PROMPT_LEN random words, in verl's row format."""
    from mcore_rl.data.rows import write_rows

    ids = torch.randint(1, 1000, (num, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [
        {"prompt": " ".join(f"w{i}" for i in r), "data_source": "bench", "reward_model": {"ground_truth": ""}}
        for r in ids
    ]
    write_rows(os.path.join(folder, "train.jsonl"), rows)


def ray_fixed_costs(actors, cfg) -> tuple[float, float]:  # -> (control call s, bulk round trip s)
    import ray

    group = actors.backend.group
    group.run("pid")
    start = time.perf_counter()
    for _ in range(20):
        group.run("pid")
    control = (time.perf_counter() - start) / 20
    width = PROMPT_LEN + NEW_TOKENS
    batch = [torch.zeros(PROMPTS * SAMPLES, width) for _ in range(4)]
    start = time.perf_counter()
    for _ in range(20):
        ray.get(ray.put(batch))
    return control, (time.perf_counter() - start) / 20


def demo_config(folder: str, threads: int, extra: list[str]):  # -> RunConfig
    """``recipes/demo_cpu.yaml`` as is (its RL step: 16 prompts x 8 samples x 6 new tokens, h128 L2), with
    its data written into ``folder`` instead of the shared ``runs/``."""
    from mcore_rl.config import load_config
    from mcore_rl.data.demo_task import prepare_data

    paths = {s: os.path.join(folder, f"{s}.parquet") for s in ("train", "val", "test", "sft")}
    cfg = load_config(
        "recipes/demo_cpu.yaml",
        [
            f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['val']}]",
            f"data.test_files=[{paths['test']}]",
            f"sft.train_files=[{paths['sft']}]",
            f"model.tokenizer_path={os.path.join(folder, 'tokenizer')}",
            f"trainer.default_local_dir={folder}",
            f"trainer.num_cpus={threads}",
            *extra,
        ],
    )
    prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)
    return cfg


def compare(cfg, total: int, warmup: int, threads: int, trl_python: Path | None, names=PATHS):
    """Alternate ``total`` RL steps on the ``names`` paths (in-process, Ray) on the same prompts (and TRL's
    step with ``trl_python``), rotating which runs first; per-step stage times after ``warmup``, rewards of
    every step, Ray's fixed costs. Returns (times, rewards, fixed costs, TRL label or None)."""
    from mcore_rl.data.prompts import PromptDataset
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.scoring import RewardScorer
    from mcore_rl.trainer.grpo import GRPOStep

    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    dataset = PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data)
    size = cfg.data.train_batch_size
    paths = {name: _actors(cfg, name, total) for name in names}
    # What each run's driver has: the in-process rank computes on the driver's threads; a Ray driver only
    # schedules, on one (``build_actor_group``).
    driver_threads = {"in-process": threads, "ray": 1, "ray-vllm": 1}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in [*paths, "trl"]}
    rewards: dict[str, list[float]] = {name: [] for name in paths}
    trl = None
    try:
        with RewardScorer(cfg.reward) as scorer:
            sides = {
                name: _rl_side(GRPOStep(cfg, actors, tokenizer, scorer), rewards[name], driver_threads[name])
                for name, actors in paths.items()
            }
            if trl_python is not None:
                trl = _trl_baseline(trl_python, dataset, threads)
                sides["trl"] = lambda prompts, step: trl.step(trl.prompts, step)
            names = list(sides)
            for step in range(1, total + 1):
                prompts = dataset.batch(range((step - 1) * size, step * size))
                turn = step % len(names)  # rotate, so that background load and cache state hit all alike
                for name in names[turn:] + names[:turn]:
                    seconds = sides[name](prompts, step)
                    if step > warmup:
                        times[name].append(seconds)
        fixed = ray_fixed_costs(paths["ray"], cfg) if "ray" in paths else None
    finally:
        if trl is not None:
            trl.close()
        for actors in paths.values():
            actors.shutdown()
    torch.set_num_threads(threads)
    return times, rewards, fixed, None if trl is None else trl.label


def _actors(cfg, name: str, total: int):
    """The actor group of path ``name`` (see :data:`PATHS`)."""
    import dataclasses

    from mcore_rl.trainer.build import build_actor_group, worker_spec

    if name == "ray-vllm":  # a KV cache of the workload's size, not the 512 MiB CPU default
        rollout = dataclasses.replace(cfg.rollout, name="vllm", kv_cache_memory_bytes=64 << 20)
        cfg = dataclasses.replace(cfg, rollout=rollout)
    return build_actor_group(cfg, worker_spec(cfg, total), use_ray=name != "in-process")


def _rl_side(rl_step, rewards: list[float], threads: int):
    def run(prompts, step: int) -> dict[str, float]:
        torch.set_num_threads(threads)
        metrics = rl_step.run(prompts, step).metrics()
        rewards.append(metrics["reward"])
        return {k[5:-2]: v for k, v in metrics.items() if k.startswith("time/")}

    return run


def _trl_baseline(python: Path, dataset, threads: int):  # -> bench_grpo_step.TrlBaseline
    """TRL 1.16's ``GRPOTrainer`` step on this workload (``bench/bench_grpo_step.py``'s subprocess); it trains
    on the bench's first prompts every step."""
    from bench.bench_grpo_step import TrlBaseline

    prompts = torch.tensor(dataset.batch(range(PROMPTS)).prompt_ids)
    if tuple(prompts.shape) != (PROMPTS, PROMPT_LEN):
        raise RuntimeError(f"TRL prompts: shape {tuple(prompts.shape)}, want {(PROMPTS, PROMPT_LEN)}")
    args = argparse.Namespace(n=SAMPLES, new_tokens=NEW_TOKENS, threads=threads)
    return TrlBaseline(python, prompts, args)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per path")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per path first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    parser.add_argument(
        "--workload", choices=("llama", "demo", "both"), default="both", help="which step(s) to time"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="KEY=VALUE config override for both paths (repeatable)",
    )
    parser.add_argument(
        "--baseline",
        choices=("none", "trl"),
        default="none",
        help="trl: also time TRL's GRPOTrainer step on the llama workload in the same rounds, which then "
        "runs as bench_grpo_step.py times ours (no reference pass, each prompt once per group)",
    )
    parser.add_argument("--trl-python", type=Path, default=None, help="python with trl installed")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(DEFAULT_PATHS),
        help="which of our paths to run (--paths ray --baseline trl: ours through Ray against TRL alone, "
        "without a third model in the rotation; --paths ray ray-vllm: the step with each rollout engine)",
    )
    args = parser.parse_args()
    trl_python = _trl_python(args, parser)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(args.threads)

    from mcore_rl.controller import RayConfig, init_ray

    total = args.warmup + args.steps
    init_ray(RayConfig(num_cpus=args.threads))
    if args.workload in ("llama", "both"):
        folder = tempfile.mkdtemp(prefix="bench_driver_")
        write_tokenizer(folder)
        write_prompts(folder, PROMPTS * total)
        title = f"{PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens, Llama h256 L4, fp32"
        extra = args.override
        if trl_python is not None:  # TRL's step: beta=0 (no reference model); ours packs shared prompts
            extra = ["algorithm.use_kl_loss=false", "model.share_prompt_prefix=true", *extra]
        cfg = run_config(folder, args.threads, extra)
        report(title, *compare(cfg, total, args.warmup, args.threads, trl_python, args.paths), args, extra)
    if args.workload in ("demo", "both"):
        cfg = demo_config(tempfile.mkdtemp(prefix="bench_driver_demo_"), args.threads, args.override)
        arch = cfg.model.arch()
        title = (
            f"demo step (recipes/demo_cpu.yaml): {cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples "
            f"x {cfg.data.max_response_length} new tokens, h{arch.hidden_size} L{arch.num_layers}, fp32"
        )
        report(title, *compare(cfg, total, args.warmup, args.threads, None, args.paths), args, args.override)
    return 0


def _trl_python(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path | None:
    """The TRL interpreter of ``--baseline trl`` (``--trl-python``, else ``bench_grpo_step``'s default)."""
    if args.baseline != "trl":
        return None
    from bench.bench_grpo_step import TRL_PYTHON

    python: Path = args.trl_python or TRL_PYTHON
    if not python.exists():
        parser.error(f"--trl-python: no interpreter at {python} (make trl-venv)")
    return python


def report(title: str, times, rewards, fixed, trl_label, args, overrides) -> None:
    median = {n: statistics.median(t["step"] for t in ts) for n, ts in times.items() if ts}
    print(
        f"GRPO step, {title}, {args.threads} threads, median of {args.steps} steps (after {args.warmup} warm-up)"
        f"{', overrides ' + ' '.join(overrides) if overrides else ''}:"
    )
    ours = [p for p in PATHS if p in median]
    print("  " + "   ".join(f"{p} {median[p]:.3f} s" for p in ours), end="")
    if "in-process" in median and "ray" in median:
        ratio = median["ray"] / median["in-process"]
        print(f"   ratio {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
        print(f"  same samples on both paths: {rewards['in-process'] == rewards['ray']} (rewards per step)")
    else:
        print()
    if "ray-vllm" in median and "ray" in median:
        ratio = median["ray-vllm"] / median["ray"]
        print(f"  step with vLLM / with the embedded engine (both through Ray): {ratio:.2f}x")
    print("  per stage (median s)   " + "".join(f"{p:>12}" for p in ours))
    for stage in times[ours[0]][0]:
        cells = "".join(f"{statistics.median(t[stage] for t in times[p]):12.4f}" for p in ours)
        print(f"    {stage:<22}{cells}")
    if trl_label is not None:
        print(f"  baseline: {trl_label}: step {median['trl']:.3f} s")
        for path in ours:
            per_round = [t["step"] / o["step"] for t, o in zip(times["trl"], times[path], strict=True)]
            print(
                f"    TRL / ours {path:<10}: {median['trl'] / median[path]:.2f}x (medians); per round median "
                f"{statistics.median(per_round):.2f}x, min {min(per_round):.2f}x, max {max(per_round):.2f}x"
            )
    if fixed is not None:
        control, bulk = fixed
        print(
            f"  Ray fixed costs: control call round trip {control * 1e3:.2f} ms; object-store put+get of one "
            f"rollout batch ({PROMPTS * SAMPLES}x{PROMPT_LEN + NEW_TOKENS} x 4 fp32 tensors) {bulk * 1e3:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
