"""One GRPO step, in-process: ours (hybrid engine + embedded rollout + TrainEngine + fused LM-head log-prob op)
against a baseline step on the same machine, and against the machine's compute limit measured in the same run.

Workload (issue 17): Llama h256, 4 layers, 8 heads MHA, intermediate 688, vocab 1000, fp32; 8 prompts x 4
samples x 32 new tokens; one Adam step. Our step = sync weights -> generate -> policy update (one optimizer
step), with verl's on-policy shortcut as ``algorithm.recompute_old_log_probs=auto`` takes it here: the old
log-probs are the update's own forward's, detached. Its micro-batch is packed as the worker packs it under
``model.share_prompt_prefix=true``: each prompt once for its 4 samples (``trainer/shared_prefix.py``;
``--no-shared-prefix`` trains on the padded rows instead). ``ours_always`` is the same step with the
separate old-log-prob forward pass (``recompute_old_log_probs=always``, the step before issue 17's
shortcut), timed in the same rounds on the same engine; ``--no-always`` leaves it out.

The baseline (``--baseline``) is TRL's ``GRPOTrainer`` (``trl``: TRL 1.16's real training step, run by
``bench/_trl_grpo.py`` as a persistent subprocess under ``--trl-python``, an interpreter with TRL installed,
by default ``.venv-trl/bin/python`` (``make trl-venv``) or ``/work/trl-venv/bin/python``, whichever exists:
installing TRL into the project venv is not allowed to change torch), or HF ``generate`` + a plain PyTorch GRPO step (``hf``: logits -> log_softmax gather ->
clipped ratio loss -> backward -> Adam, which is what TRL runs underneath), or ``both``. Without a TRL
interpreter the default is ``hf``. The subprocess uses our thread count and blocks on its stdin while our
side runs, so the two never compute at the same time; ``bench/_trl_grpo.py`` says how its step is timed.

The compute limit is the step's matmul FLOPs divided by ``torch.mm``'s rate at the step's own GEMM shapes
(decode shapes for generation; forward, input-gradient and weight-gradient shapes over the packed tokens for
training), timed in this process once per round beside the steps; the best round counts. Rounds alternate
which side runs first; the report gives medians and the min-max spread.

    python -m bench.bench_grpo_step --rounds 8 --threads 2 [--baseline both] [--trl-python PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.bench_rollout import HF_CONFIG
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.shared_prefix import shared_prefix_packing
from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.workers.losses import (
    LogProbMicroBatch,
    PolicyLossSettings,
    PolicyMicroBatch,
    log_prob_loss,
    policy_loss,
)
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import TrainBatch

HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 256, 4, 8, 688, 1000
# the default --trl-python: the first that exists (``make trl-venv`` builds the first)
TRL_PYTHONS = (Path(__file__).parents[1] / ".venv-trl/bin/python", Path("/work/trl-venv/bin/python"))
TRL_PYTHON = next((p for p in TRL_PYTHONS if p.exists()), TRL_PYTHONS[0])
TRL_CHILD = Path(__file__).with_name("_trl_grpo.py")
LR = 1e-6  # every side's Adam learning rate
SPLIT = ("generate", "forward_backward", "optimizer")  # the baselines' step split, in order


def _hf_config() -> dict:
    return {
        **HF_CONFIG,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }


def _advantages(responses: torch.Tensor, group: int) -> torch.Tensor:
    """[N] group-normalised rewards of a fixed toy reward (share of even token ids)."""
    reward = (responses % 2 == 0).float().mean(dim=1).view(-1, group)
    return ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)


def _flops(n: int, prompt: int, new: int, samples: int = 1, recompute: bool = False) -> dict[str, float]:
    """Matmul FLOPs of one step over ``n`` sequences (``samples`` per prompt): linear layers, causal
    attention (QK^T + AV), the LM head where it runs; ``recompute``: with the separate old-log-prob forward."""
    per_token = 2 * LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    seq = prompt + new

    def attention(length: int) -> float:  # causal: sum over positions of 2 x 2 x t x h per layer
        return 4.0 * LAYERS * HIDDEN * length * (length + 1) / 2

    head = 2 * HIDDEN * VOCAB
    generate = n * (seq * per_token + attention(seq) + new * head)
    forward = n * (seq * per_token + attention(seq) + new * head)  # head only at response positions
    # with shared prompts (model.share_prompt_prefix) the linear layers skip n - n / samples prompt copies
    shared = forward - (n - n // samples) * prompt * per_token
    # update (forward + 2x backward), plus the old log-probs' forward (1x) when recomputed
    passes = 4 if recompute else 3
    return {"generate": generate, "train": passes * forward, "train_shared": passes * shared}


def _gemm_shapes(n: int, seq: int) -> dict[str, list[tuple[int, int, int]]]:
    """(rows, inner, cols) of the step's linear GEMMs: decode steps (``n`` rows), and training over
    ``n * seq`` tokens, forward (x @ W), input gradient (g @ W^T) and weight gradient (x^T @ g) alike."""
    linears = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    tokens = n * seq
    train = [(tokens, k, c) for k, c in linears] + [(tokens, c, k) for k, c in linears]
    train += [(k, tokens, c) for k, c in linears]
    return {"decode": [(n, k, c) for k, c in [*linears, (HIDDEN, VOCAB)]], "train": train}


def _gemm_rate(shapes: list[tuple[int, int, int]], reps: int = 5) -> float:
    """GFLOP/s of ``torch.mm`` over ``shapes`` (median of ``reps`` timings of the whole set)."""
    mats = [(torch.randn(m, k), torch.randn(k, c)) for m, k, c in shapes]
    flops = sum(2 * m * k * c for m, k, c in shapes)
    for a, b in mats:  # warm-up: first touch of the operands and MKL's per-shape set-up
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for a, b in mats:
            torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times) / 1e9


class GemmRate:
    """The machine's GEMM rate at the step's shapes, timed once per round beside the steps: the limit uses
    the best round (the fastest this machine ran those GEMMs in this run), so a noisy moment cannot make
    the limit look easy to reach."""

    def __init__(self, n: int, seq: int) -> None:
        self.shapes = _gemm_shapes(n, seq)
        self.best = {kind: 0.0 for kind in self.shapes}

    def step(self, prompts: torch.Tensor, seed: int) -> dict[str, float]:
        start = time.perf_counter()
        for kind, shapes in self.shapes.items():
            self.best[kind] = max(self.best[kind], _gemm_rate(shapes))
        return {"step": time.perf_counter() - start}


class Ours:
    """Our GRPO step on one in-process rank."""

    def __init__(self, ctx: ParallelContext, args: argparse.Namespace) -> None:
        self.arch = ModelArch.from_hf_config(_hf_config())
        self.engine = TrainEngine.build(self.arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=LR))
        self.hybrid, self.rollout = build_local_hybrid(self.engine)
        self.args = args
        self.settings = PolicyLossSettings(vocab_size=VOCAB, temperature=1.0)

    def _packed(self, micro: MicroBatch) -> MicroBatch:
        """The worker's packing (``HybridWorker._packed``): each prompt once for its n samples."""
        if self.args.share_prompt_prefix:
            mask = micro.mask if isinstance(micro, LogProbMicroBatch) else micro.train.response_mask
            micro.packed = shared_prefix_packing(micro.tokens, mask).model_input()
        return micro

    def step(self, prompts: torch.Tensor, seed: int, recompute: bool = False) -> dict[str, float]:
        """One step; ``recompute`` runs the separate old-log-prob forward (else the on-policy shortcut)."""
        args, t = self.args, [time.perf_counter()]
        self.hybrid.to_rollout()
        t.append(time.perf_counter())
        params = SamplingParams(temperature=1.0, n=args.n, max_new_tokens=args.new_tokens, seed=seed)
        out = self.rollout.generate(prompts.tolist(), params)
        t.append(time.perf_counter())
        self.hybrid.to_train()
        p = prompts.shape[1]
        tokens = torch.cat([prompts[out.prompt_index], out.token_ids], dim=1)
        mask = torch.zeros(tokens.shape)
        mask[:, p - 1 : p - 1 + args.new_tokens] = out.response_mask().float()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        settings, old_log_probs = dataclasses.replace(self.settings, on_policy=True), None
        if recompute:
            micro_old: list[MicroBatch] = [self._packed(LogProbMicroBatch(tokens, positions, mask=mask))]
            old = self.engine.forward_backward(micro_old, log_prob_loss(VOCAB, 1.0), forward_only=True)
            settings, old_log_probs = self.settings, old[0].log_probs
        t.append(time.perf_counter())
        adv = _advantages(out.token_ids, args.n)[:, None] * mask
        unread = torch.full(mask.shape, math.nan)  # the shortcut's loss never reads the old log-probs
        old_or_unread = unread if old_log_probs is None else old_log_probs
        batch = TrainBatch(tokens, mask, old_or_unread, adv, torch.zeros_like(mask))
        micro: list[MicroBatch] = [self._packed(PolicyMicroBatch(tokens, positions, train=batch))]
        self.engine.zero_grad()
        count = mask.sum()
        self.engine.forward_backward(micro, policy_loss(settings, count, torch.tensor(float(len(tokens)))))
        t.append(time.perf_counter())
        self.engine.step()
        t.append(time.perf_counter())
        names = ("reshard", "generate", "old_log_probs", "forward_backward", "optimizer")
        return {"step": t[-1] - t[0], **{k: b - a for k, a, b in zip(names, t[:-1], t[1:], strict=True)}}


class Baseline:
    """HF ``generate`` + a plain PyTorch GRPO step (TRL's computation with num_iterations=1)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = {k: v for k, v in _hf_config().items() if k not in ("architectures", "model_type")}
        self.model = LlamaForCausalLM(LlamaConfig(**config))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.args = args

    def step(self, prompts: torch.Tensor, seed: int) -> dict[str, float]:
        args, t = self.args, [time.perf_counter()]
        torch.manual_seed(seed)
        self.model.eval()
        with torch.no_grad():
            tokens = self.model.generate(
                prompts.repeat_interleave(args.n, 0),
                attention_mask=torch.ones(len(prompts) * args.n, prompts.shape[1], dtype=torch.long),
                do_sample=True,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
                top_k=0,
            )
        t.append(time.perf_counter())
        self.model.train()
        p = prompts.shape[1]
        logits = self.model(tokens).logits[:, p - 1 : -1]  # TRL keeps the completion positions
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, p:, None]).squeeze(-1)
        adv = _advantages(tokens[:, p:], args.n)[:, None]
        loss = -(torch.exp(logp - logp.detach()) * adv).mean()
        loss.backward()
        t.append(time.perf_counter())
        self.optimizer.step()
        self.optimizer.zero_grad()
        t.append(time.perf_counter())
        return {"step": t[-1] - t[0], **{k: b - a for k, a, b in zip(SPLIT, t[:-1], t[1:], strict=True)}}


class TrlBaseline:
    """TRL's ``GRPOTrainer`` step, run by ``bench/_trl_grpo.py`` as a persistent subprocess under ``python``.

    It builds the same model (``_hf_config()``, random init, fp32) and trains on ``prompts`` every step; its
    RNG is seeded once, so ``step``'s ``seed`` is not passed on. Each reply carries TRL's own record of the
    completions it trained on, checked here: a step over other lengths would not be this workload.
    """

    def __init__(self, python: Path, prompts: torch.Tensor, args: argparse.Namespace) -> None:
        config = {k: v for k, v in _hf_config().items() if k not in ("architectures", "model_type")}
        spec = {
            "hf_config": config,
            "prompts": prompts.tolist(),
            "prompts_per_step": len(prompts),
            "num_generations": args.n,
            "new_tokens": args.new_tokens,
            "lr": LR,
            "seed": 0,
            "threads": args.threads,
        }
        # The child must see only its own venv: a PYTHONPATH into ours would mix two torch installs.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.python, self.args, self.prompts = python, args, prompts
        # Lives as long as the subprocess (closed in close()); read back only to report a crash.
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), str(TRL_CHILD), "--spec", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        ready = self._read()
        checks = {"threads": args.threads, "mixed_precision": "no", "activation_checkpointing": False}
        checks["dtype"] = "torch.float32"
        wrong = {k: ready.get(k) for k, v in checks.items() if ready.get(k) != v}
        if wrong:
            self.close()
            raise RuntimeError(
                f"--trl-python: the TRL step does not run this workload: {wrong} (want {checks})"
            )
        self.label = f"TRL {ready['trl']} GRPOTrainer, subprocess {python}"
        self.label += f" (torch {ready['torch']}, {ready['threads']} threads)"

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            tail = "".join(self.stderr.readlines()[-20:])
            raise RuntimeError(
                f"--trl-python: {self.python} {TRL_CHILD} exited ({self.proc.wait()}):\n{tail}"
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    def step(self, prompts: torch.Tensor, seed: int) -> dict[str, float]:
        if not torch.equal(prompts, self.prompts):
            raise ValueError("TrlBaseline.step: prompts differ from the ones its subprocess was built with")
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        out = self._read()
        got = (out["completion_len_min"], out["completion_len_max"], out["num_completions"])
        want = (self.args.new_tokens, self.args.new_tokens, len(prompts) * self.args.n)
        if got != want:
            raise RuntimeError(f"TRL step: (min length, max length, completions) = {got}, want {want}")
        return {"step": out["step"], **{k: out[k] for k in SPLIT}}

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.stderr.close()


def _summary(rows: list[dict[str, float]]) -> str:
    return ", ".join(f"{k} {statistics.median(r[k] for r in rows):.3f}s" for k in rows[0])


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def _ratio(rows: dict[str, list[dict[str, float]]], num: str, den: str) -> str:
    return _spread([a["step"] / b["step"] for a, b in zip(rows[num], rows[den], strict=True)])


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--no-always", action="store_true", help="leave out ours_always (the separate old-log-prob pass)"
    )
    parser.add_argument(
        "--no-shared-prefix",
        dest="share_prompt_prefix",
        action="store_false",
        help="train on padded rows (model.share_prompt_prefix=false) instead of each prompt once per group",
    )
    parser.add_argument(
        "--baseline",
        choices=("trl", "hf", "both"),
        help="TRL's GRPOTrainer, HF generate + plain PyTorch GRPO step, or both (default: trl with a TRL python)",
    )
    parser.add_argument(
        "--trl-python",
        type=Path,
        default=TRL_PYTHON if TRL_PYTHON.exists() else None,
        help=f"python with trl installed (default: {TRL_PYTHON} where it exists)",
    )
    args = parser.parse_args()
    if args.baseline is None:
        args.baseline = "trl" if args.trl_python is not None else "hf"
    if args.baseline != "hf" and (args.trl_python is None or not args.trl_python.exists()):
        parser.error(f"--trl-python: no interpreter at {args.trl_python} (give one, or --baseline hf)")
    return args


def _run_rounds(
    sides: dict[str, Callable[[torch.Tensor, int], dict[str, float]]], prompts: torch.Tensor, rounds: int
) -> dict[str, list[dict[str, float]]]:
    for fn in sides.values():  # warm-up
        fn(prompts, 0)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for r in range(rounds):  # the order rotates, so that each side runs first in some rounds
        names = list(sides)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rows[name].append(sides[name](prompts, r + 1))
    return rows


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompts = torch.randint(1, VOCAB, (args.prompts, args.prompt_len))
    gemm = GemmRate(args.prompts * args.n, args.prompt_len + args.new_tokens)
    labels: dict[str, str] = {}
    trl = None
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        ours = Ours(ctx, args)
        sides: dict[str, Callable[[torch.Tensor, int], dict[str, float]]] = {"ours": ours.step}
        sides["gemm"] = gemm.step
        try:
            if args.baseline in ("trl", "both"):
                trl = TrlBaseline(args.trl_python, prompts, args)
                sides["trl"], labels["trl"] = trl.step, trl.label
            if args.baseline in ("hf", "both"):
                sides["hf"] = Baseline(args).step
                labels["hf"] = "HF generate + plain PyTorch GRPO step"
            if not args.no_always:
                sides["ours_always"] = lambda p, seed: ours.step(p, seed, recompute=True)
            rows = _run_rounds(sides, prompts, args.rounds)
        finally:
            if trl is not None:
                trl.close()
    _report(args, rows, labels, (gemm.best["decode"], gemm.best["train"]))


def _report(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, float]]],
    labels: dict[str, str],
    rates: tuple[float, float],
) -> None:
    """``rates``: torch.mm GFLOP/s at the decode and the training shapes (best round)."""
    n = args.prompts * args.n
    flops = _flops(n, args.prompt_len, args.new_tokens, args.n)
    rate_decode, rate_train = rates
    limit_s = flops["generate"] / (rate_decode * 1e9) + flops["train"] / (rate_train * 1e9)
    primary = "trl" if "trl" in rows else "hf"
    print(f"workload: {n} sequences x ({args.prompt_len} + {args.new_tokens}) tokens, {args.threads} threads")
    print(f"baseline ran: {' and '.join(labels[k] for k in ('trl', 'hf') if k in labels)}")
    print(f"ours:     {_summary(rows['ours'])}")
    print(f"baseline: {_summary(rows[primary])}  ({labels[primary]})")
    if primary == "trl" and "hf" in rows:
        print(f"hf:       {_summary(rows['hf'])}  ({labels['hf']})")
    print(f"step FLOPs: generate {flops['generate'] / 1e9:.2f} G, train {flops['train'] / 1e9:.2f} G")
    if args.share_prompt_prefix:
        print(
            f"  ours computes train {flops['train_shared'] / 1e9:.2f} G of them (each prompt once per group, "
            "model.share_prompt_prefix); the limit below counts the workload's full FLOPs"
        )
    print(
        f"torch.mm, best round: {rate_decode:.1f} GFLOP/s at decode shapes, {rate_train:.1f} GFLOP/s at "
        "training shapes (forward, input and weight gradients)"
    )
    print(f"compute limit of the step: {limit_s:.3f}s")
    if "trl" in rows:
        print(f"ratio TRL/ours (per round): {_ratio(rows, 'trl', 'ours')}")
    if "hf" in rows:
        print(
            f"ratio {'baseline' if primary == 'hf' else 'HF'}/ours (per round): {_ratio(rows, 'hf', 'ours')}"
        )
    if "trl" in rows and "hf" in rows:
        print(f"ratio TRL/HF (per round): {_ratio(rows, 'trl', 'hf')}")
    if "ours_always" in rows:
        print(f"ours_always: {_summary(rows['ours_always'])}  (recompute_old_log_probs=always)")
        print(
            f"ratio ours_always/ours, the shortcut's speed-up (per round): {_ratio(rows, 'ours_always', 'ours')}"
        )
    for name in ("ours", *labels):
        step_s = statistics.median(r["step"] for r in rows[name])
        print(f"{name} vs compute limit: {limit_s / step_s:.0%} of the limit")


if __name__ == "__main__":
    main()
