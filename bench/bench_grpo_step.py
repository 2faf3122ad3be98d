"""One GRPO step, in-process: ours (hybrid engine + embedded rollout + TrainEngine + fused LM-head log-prob op)
against a baseline step on the same machine, and against the machine's limits measured in the same run.

Workloads (``--model``; each sets the defaults of ``--n`` and ``--new-tokens``):
- ``tiny`` (issue 17): Llama h256, 4 layers, 8 heads MHA, intermediate 688, vocab 1000, fp32; 8 prompts x 4
  samples x 32 new tokens.
- ``realistic`` (issue 33): Llama h512, 8 layers, 8 query heads / 2 KV heads, intermediate 1376, vocab 32000,
  fp32; 8 prompts x 8 samples x 128 new tokens.
Prompts are 16 tokens; one Adam step per batch. Our step = sync weights -> generate -> policy update (one
optimizer step), with verl's on-policy shortcut as ``algorithm.recompute_old_log_probs=auto`` takes it here:
the old log-probs are the update's own forward's, detached. Its micro-batch is packed as the worker packs it
under ``model.share_prompt_prefix=true``: each prompt once for its n samples (``trainer/shared_prefix.py``;
``--no-shared-prefix`` trains on the padded rows instead). ``ours_always`` is the same step with the
separate old-log-prob forward pass (``recompute_old_log_probs=always``, the step before issue 17's
shortcut), timed in the same rounds on the same engine; ``--no-always`` leaves it out.

The baseline (``--baseline``) is TRL's ``GRPOTrainer`` (``trl``: TRL 1.16's real training step, run by
``bench/_trl_grpo.py`` as a persistent subprocess under ``--trl-python``, an interpreter with TRL installed,
by default ``.venv-trl/bin/python`` (``make trl-venv``) or ``/work/trl-venv/bin/python``, whichever exists:
installing TRL into the project venv is not allowed to change torch), or HF ``generate`` + a plain PyTorch
GRPO step (``hf``: logits -> log_softmax gather -> clipped ratio loss -> backward -> Adam, which is what TRL
runs underneath), or ``both``. Without a TRL interpreter the default is ``hf``. The subprocess builds the
same model from the same HF config, uses our thread count and blocks on its stdin while our side runs, so
the two never compute at the same time; ``bench/_trl_grpo.py`` says how its step is timed.

Limits, each phase against its own. Compute-bound phases: matmul FLOPs (linear layers with K/V over the KV
heads, causal attention, the LM head wherever it runs) divided by ``torch.mm``'s rate at the phase's own
GEMM shapes: decode shapes (one head GEMM per decode step) for ``generate``; forward, input-gradient and
weight-gradient shapes over the training tokens (the head over the response tokens) for ``update``
(forward + backward) and ``log_probs`` (forward only; only ``ours_always`` runs it), timed in this process
once per round beside the steps; the best round counts. Memory-bound phases, against ``Tensor.copy_``'s
bandwidth measured in the same run: ``sync`` (the bytes handed to the rollout engine, copied once) and
``optimizer`` (Adam's reads and writes). The compute limit of the step is generate + update, at the
workload's full FLOPs. Peak RSS per phase: the kernel's high-water mark, reset before each phase, on our
side and inside TRL's subprocess. Rounds alternate which side runs first; the report gives medians and the
min-max spread; ``--json PATH`` writes all of it as one object.

    python -m bench.bench_grpo_step --rounds 8 --threads 2 [--model realistic] [--baseline both] [--json PATH]
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

from bench._measure import memcpy_bytes_per_s, mm_seconds, peak_rss_bytes, reset_peak_rss
from bench._rollout_models import model_config
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

WORKLOADS: dict[str, dict[str, Any]] = {
    # issue 17's model is the rollout bench's tiny one with full multi-head attention
    "tiny": {"hf_config": model_config("tiny", kv_heads=8), "n": 4, "new_tokens": 32},
    "realistic": {"hf_config": model_config("realistic"), "n": 8, "new_tokens": 128},
}
"""``--model`` -> the HF config both sides build, and the defaults of ``--n`` and ``--new-tokens``."""
# the default --trl-python: the first that exists (``make trl-venv`` builds the first)
TRL_PYTHONS = (Path(__file__).parents[1] / ".venv-trl/bin/python", Path("/work/trl-venv/bin/python"))
TRL_PYTHON = next((p for p in TRL_PYTHONS if p.exists()), TRL_PYTHONS[0])
TRL_CHILD = Path(__file__).with_name("_trl_grpo.py")
LR = 1e-6  # every side's Adam learning rate
SPLIT = ("generate", "forward_backward", "optimizer")  # the baselines' step split, in order
PHASES = ("sync", "generate", "to_train", "log_probs", "update", "optimizer")
"""The report's phases, in step order; a baseline's ``forward_backward`` is its ``update``."""
PHASE_OF = {"forward_backward": "update"}
ADAM_BYTES_PER_PARAM = 7 * 4
"""fp32 Adam reads the parameter, its gradient and both moments and writes the parameter and both moments."""
Gemm = tuple[int, int, int, int]
"""(rows, inner, cols, count): ``count`` products of a ``[rows, inner]`` by an ``[inner, cols]`` matrix."""


def _hf_config(model: str = "tiny") -> dict[str, Any]:
    return dict(WORKLOADS[model]["hf_config"])


def _advantages(responses: torch.Tensor, group: int) -> torch.Tensor:
    """[N] group-normalised rewards of a fixed toy reward (share of even token ids)."""
    reward = (responses % 2 == 0).float().mean(dim=1).view(-1, group)
    return ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)


def linear_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """(in, out) of one layer's linear layers: fused QKV (K and V over the KV heads only), the attention
    output, fused gate + up, down."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    h, f = arch.hidden_size, arch.ffn_hidden_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]


def param_count(arch: ModelArch) -> int:
    """Parameters of the (Llama-style, bias-free) model: linear layers, two RMSNorms per layer and the final
    one, the embedding and, untied, the LM head."""
    per_layer = sum(k * c for k, c in linear_shapes(arch)) + 2 * arch.hidden_size
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * per_layer + embeddings + arch.hidden_size


def step_flops(arch: ModelArch, n: int, prompt: int, new: int, samples: int = 1) -> dict[str, float]:
    """Matmul FLOPs of each phase of one step over ``n`` sequences (``samples`` per prompt): linear layers,
    causal attention (QK^T + AV over the query heads), the LM head where it runs. ``*_shared``: what the
    training passes compute with each prompt once per group (``model.share_prompt_prefix``)."""
    per_token = 2 * arch.num_layers * sum(k * c for k, c in linear_shapes(arch))
    q, seq = arch.num_attention_heads * arch.head_dim, prompt + new

    def attention(length: int) -> float:  # causal: sum over positions of 2 x 2 x t x q per layer
        return 4.0 * arch.num_layers * q * length * (length + 1) / 2

    head = 2 * arch.hidden_size * arch.vocab_size
    generate = n * (seq * per_token + attention(seq) + new * head)  # one head GEMM per decode step
    forward = n * (seq * per_token + attention(seq) + new * head)  # head only at response positions
    shared = forward - (n - n // samples) * prompt * per_token  # the linears skip the prompt copies
    return {
        "generate": generate,
        "log_probs": forward,
        "update": 3 * forward,  # forward + input gradients + weight gradients
        "log_probs_shared": shared,
        "update_shared": 3 * shared,
    }


def gemm_shapes(arch: ModelArch, n: int, prompt: int, new: int) -> dict[str, list[Gemm]]:
    """The step's GEMMs per pass: ``decode``, one decode step of ``n`` rows (each layer's linears and the
    head); ``train``, the forward (x @ W), input-gradient (g @ W^T) and weight-gradient (x^T @ g) GEMMs over
    the ``n * (prompt + new)`` training tokens, the head's over the ``n * new`` response tokens."""
    layers, h, vocab = arch.num_layers, arch.hidden_size, arch.vocab_size
    tokens, responses = n * (prompt + new), n * new
    linears = linear_shapes(arch)
    decode = [(n, k, c, layers) for k, c in linears] + [(n, h, vocab, 1)]
    forward = [(tokens, k, c, layers) for k, c in linears] + [(responses, h, vocab, 1)]
    input_grad = [(m, c, k, count) for m, k, c, count in forward]
    weight_grad = [(k, m, c, count) for m, k, c, count in forward]
    return {"decode": decode, "train": forward + input_grad + weight_grad}


def gemm_flops(gemms: list[Gemm]) -> float:
    return float(sum(2 * m * k * c * count for m, k, c, count in gemms))


def phase_limits(
    flops: dict[str, float], gflops: dict[str, float], copy_bytes_per_s: float, params: int, sync_bytes: int
) -> dict[str, float]:
    """Seconds each phase needs at the machine's rates: compute-bound ones at ``torch.mm``'s GFLOP/s at their
    shapes, memory-bound ones at the copy bandwidth (a copy reads and writes each byte: 2 bytes of traffic
    per byte copied, which Adam's reads and writes are counted in)."""
    return {
        "sync": sync_bytes / copy_bytes_per_s,
        "generate": flops["generate"] / (gflops["decode"] * 1e9),
        "log_probs": flops["log_probs"] / (gflops["train"] * 1e9),
        "update": flops["update"] / (gflops["train"] * 1e9),
        "optimizer": params * ADAM_BYTES_PER_PARAM / (2 * copy_bytes_per_s),
    }


class GemmRate:
    """The machine's GEMM rate at the step's shapes, timed once per round beside the steps (each distinct
    shape by itself, weighted by how often a pass runs it): the limit uses the best round (the fastest this
    machine ran those GEMMs in this run), so a noisy moment cannot make the limit look easy to reach."""

    def __init__(self, shapes: dict[str, list[Gemm]]) -> None:
        self.shapes = shapes
        self.best = {kind: 0.0 for kind in shapes}

    def step(self, prompts: torch.Tensor, seed: int) -> dict[str, float]:
        start = time.perf_counter()
        for kind, gemms in self.shapes.items():
            # small GEMMs take more repeats: a few tenths of a millisecond are noisy
            seconds = sum(
                count * mm_seconds(m, k, c, reps=3 if m * k * c > 5e8 else 15) for m, k, c, count in gemms
            )
            self.best[kind] = max(self.best[kind], gemm_flops(gemms) / seconds / 1e9)
        return {"step": time.perf_counter() - start}


class _PhaseClock:
    """Times consecutive phases and the peak RSS of each (the high-water mark is reset as a phase starts)."""

    def __init__(self) -> None:
        self.row: dict[str, float] = {}
        self.first = self.start = time.perf_counter()
        reset_peak_rss()

    def end(self, phase: str) -> None:
        now = time.perf_counter()
        self.row[phase], self.row[f"rss:{phase}"] = now - self.start, float(peak_rss_bytes())
        reset_peak_rss()
        self.start = time.perf_counter()

    def done(self) -> dict[str, float]:
        return {"step": time.perf_counter() - self.first, **self.row}


class Ours:
    """Our GRPO step on one in-process rank."""

    def __init__(self, ctx: ParallelContext, args: argparse.Namespace) -> None:
        self.arch = ModelArch.from_hf_config(args.hf_config)
        self.engine = TrainEngine.build(self.arch, ctx, optim=OptimConfig(weight_decay=0.0, lr=LR))
        self.hybrid, self.rollout = build_local_hybrid(self.engine)
        self.args = args
        self.settings = PolicyLossSettings(vocab_size=self.arch.vocab_size, temperature=1.0)
        self.sync_bytes = 0
        """Bytes of the tensors the last weight sync handed to the rollout engine's ``load_weights``."""
        convert = self.hybrid.to_rollout_tensors

        def counted(shards: dict[str, torch.Tensor]) -> Any:
            self.sync_bytes = 0
            for name, tensor in convert(shards):
                self.sync_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.hybrid.to_rollout_tensors = counted

    def _packed(self, micro: MicroBatch) -> MicroBatch:
        """The worker's packing (``HybridWorker._packed``): each prompt once for its n samples."""
        if self.args.share_prompt_prefix:
            mask = micro.mask if isinstance(micro, LogProbMicroBatch) else micro.train.response_mask
            micro.packed = shared_prefix_packing(micro.tokens, mask).model_input()
        return micro

    def step(self, prompts: torch.Tensor, seed: int, recompute: bool = False) -> dict[str, float]:
        """One step; ``recompute`` runs the separate old-log-prob forward (else the on-policy shortcut)."""
        args, clock, vocab = self.args, _PhaseClock(), self.arch.vocab_size
        self.hybrid.to_rollout()
        clock.end("sync")
        params = SamplingParams(temperature=1.0, n=args.n, max_new_tokens=args.new_tokens, seed=seed)
        out = self.rollout.generate(prompts.tolist(), params)
        clock.end("generate")
        self.hybrid.to_train()
        p = prompts.shape[1]
        tokens = torch.cat([prompts[out.prompt_index], out.token_ids], dim=1)
        mask = torch.zeros(tokens.shape)
        mask[:, p - 1 : p - 1 + args.new_tokens] = out.response_mask().float()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        clock.end("to_train")
        settings, old_log_probs = dataclasses.replace(self.settings, on_policy=True), None
        if recompute:
            micro_old: list[MicroBatch] = [self._packed(LogProbMicroBatch(tokens, positions, mask=mask))]
            old = self.engine.forward_backward(micro_old, log_prob_loss(vocab, 1.0), forward_only=True)
            settings, old_log_probs = self.settings, old[0].log_probs
            clock.end("log_probs")
        adv = _advantages(out.token_ids, args.n)[:, None] * mask
        unread = torch.full(mask.shape, math.nan)  # the shortcut's loss never reads the old log-probs
        old_or_unread = unread if old_log_probs is None else old_log_probs
        batch = TrainBatch(tokens, mask, old_or_unread, adv, torch.zeros_like(mask))
        micro: list[MicroBatch] = [self._packed(PolicyMicroBatch(tokens, positions, train=batch))]
        self.engine.zero_grad()
        count = mask.sum()
        self.engine.forward_backward(micro, policy_loss(settings, count, torch.tensor(float(len(tokens)))))
        clock.end("update")
        self.engine.step()
        clock.end("optimizer")
        return clock.done()


class Baseline:
    """HF ``generate`` + a plain PyTorch GRPO step (TRL's computation with num_iterations=1)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = {k: v for k, v in args.hf_config.items() if k not in ("architectures", "model_type")}
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

    It builds the same model (``args.hf_config``, by default the tiny model; random init, fp32), checked
    against the config its model reports, and trains on ``prompts`` every step; its RNG is seeded once, so
    ``step``'s ``seed`` is not passed on. Each reply carries TRL's own record of the completions it trained
    on, checked here (a step over other lengths would not be this workload), and the peak RSS of each phase
    of its step (``rss:<phase>``, bytes).
    """

    def __init__(self, python: Path, prompts: torch.Tensor, args: argparse.Namespace) -> None:
        hf_config = getattr(args, "hf_config", None) or _hf_config()
        config = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
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
        checks["model"] = {k: config.get(k) for k in ready.get("model", {"hidden_size": None})}
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
        rss = {f"rss:{k}": float(v) for k, v in out["peak_rss"].items()}
        return {"step": out["step"], **{k: out[k] for k in SPLIT}, **rss}

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.stderr.close()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny", help="the workload (see above)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument(
        "--n", type=int, help="samples per prompt (default: the model's, 4 tiny, 8 realistic)"
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, help="default: the model's, 32 tiny, 128 realistic")
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
    parser.add_argument("--json", type=Path, help="also write everything the report prints to this file")
    args = parser.parse_args()
    workload = WORKLOADS[args.model]
    args.hf_config = dict(workload["hf_config"])
    for name in ("n", "new_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, workload[name])
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.baseline is None:
        args.baseline = "trl" if args.trl_python is not None else "hf"
    if args.baseline != "hf" and (args.trl_python is None or not args.trl_python.exists()):
        parser.error(f"--trl-python: no interpreter at {args.trl_python} (give one, or --baseline hf)")
    return args


def _run_rounds(
    sides: dict[str, Callable[[torch.Tensor, int], dict[str, float]]],
    prompts: torch.Tensor,
    rounds: int,
    unwarmed: tuple[str, ...] = (),
) -> dict[str, list[dict[str, float]]]:
    """``unwarmed``: sides that warm themselves up inside each call (the GEMM timing)."""
    for name, fn in sides.items():  # warm-up
        if name not in unwarmed:
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
    prompts = torch.randint(1, args.hf_config["vocab_size"], (args.prompts, args.prompt_len))
    labels = {"ours": "ours", "ours_always": "ours, recompute_old_log_probs=always"}
    trl = None
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        ours = Ours(ctx, args)
        gemm = GemmRate(gemm_shapes(ours.arch, args.prompts * args.n, args.prompt_len, args.new_tokens))
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
            rows = _run_rounds(sides, prompts, args.rounds, unwarmed=("gemm",))
        finally:
            if trl is not None:
                trl.close()
        last_sync = next(t for t in reversed(ours.hybrid.history) if t.target.value == "rollout")
        sync = {"bytes": ours.sync_bytes, "steps_s": last_sync.steps_s}
    sync["copy_bytes_per_s"] = memcpy_bytes_per_s(ours.sync_bytes)
    del rows["gemm"]
    record = _record(args, ours.arch, rows, labels, gemm.best, sync)
    _print(record)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratio(num: list[dict[str, float]], den: list[dict[str, float]]) -> dict[str, Any]:
    """Step-time ratios of two sides, round by round (each round's pair ran back to back)."""
    per_round = [a["step"] / b["step"] for a, b in zip(num, den, strict=True)]
    return {"per_round": per_round, **_stats(per_round)}


def _side_record(
    rows: list[dict[str, float]], tokens: int, limits: dict[str, float], compute_limit_s: float
) -> dict[str, Any]:
    """One side's figures over the timed rounds: step and phase seconds, tokens/s, % of the limits, peak RSS
    per phase (the most of any round)."""
    phases = {
        PHASE_OF.get(k, k): _stats([r[k] for r in rows]) for k in rows[0] if k != "step" and ":" not in k
    }
    rss = {
        PHASE_OF.get(k[4:], k[4:]): max(r[k] for r in rows) / 2**20 for k in rows[0] if k.startswith("rss:")
    }
    step = _stats([r["step"] for r in rows])
    return {
        "step_s": step,
        "phases_s": phases,
        "tokens_per_s": _stats([tokens / r["step"] for r in rows]),
        "compute_limit_percent": 100 * compute_limit_s / step["median"],
        "phase_limit_percent": {k: 100 * limits[k] / v["median"] for k, v in phases.items() if k in limits},
        "peak_rss_mib": rss,
    }


def _record(
    args: argparse.Namespace,
    arch: ModelArch,
    rows: dict[str, list[dict[str, float]]],
    labels: dict[str, str],
    gflops: dict[str, float],
    sync: dict[str, Any],
) -> dict[str, Any]:
    """Everything the report prints, as one JSON-ready object (``--json``)."""
    n = args.prompts * args.n
    flops = step_flops(arch, n, args.prompt_len, args.new_tokens, args.n)
    copy_rate = sync["copy_bytes_per_s"]
    limits = phase_limits(flops, gflops, copy_rate, param_count(arch), sync["bytes"])
    compute_limit_s = limits["generate"] + limits["update"]
    sides = {
        name: {"label": labels[name], **_side_record(r, n * args.new_tokens, limits, compute_limit_s)}
        for name, r in rows.items()
    }
    pairs = [("trl", "ours"), ("hf", "ours"), ("trl", "hf"), ("ours_always", "ours")]
    ratios = {f"{a}/{b}": _ratio(rows[a], rows[b]) for a, b in pairs if a in rows and b in rows}
    sync_s = sides["ours"]["phases_s"]["sync"]["median"]
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "hf_config"},
        "model": {"name": args.model, "hf_config": args.hf_config, "params": param_count(arch)},
        "workload": {"sequences": n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "sides": sides,
        "ratios": ratios,
        "limits": {
            "flops": flops,
            "gemm_gflop_per_s": gflops,
            "copy_gb_per_s": copy_rate / 1e9,
            "phase_s": limits,
            "compute_s": compute_limit_s,
        },
        "sync": {
            "bytes": sync["bytes"],
            "seconds": sync_s,
            "gb_per_s": sync["bytes"] / sync_s / 1e9,
            "copy_gb_per_s": copy_rate / 1e9,
            "percent_of_copy": 100 * sync["bytes"] / sync_s / copy_rate,
            "transition_steps_s": sync["steps_s"],
        },
    }


def _spread(stats: dict[str, float], digits: int = 3) -> str:
    return (
        f"median {stats['median']:.{digits}f} (min {stats['min']:.{digits}f}, max {stats['max']:.{digits}f})"
    )


def _times(side: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v['median']:.3f}s" for k, v in side["phases_s"].items())
    return f"step {side['step_s']['median']:.3f}s, {phases}"


def _print(record: dict[str, Any]) -> None:
    args, sides, limits = record["args"], record["sides"], record["limits"]
    a, w = ModelArch.from_hf_config(record["model"]["hf_config"]), record["workload"]
    print(
        f"workload: {args['model']} model (h{a.hidden_size}, {a.num_layers} layers, {a.num_attention_heads} "
        f"heads / {a.num_query_groups} KV heads, ffn {a.ffn_hidden_size}, vocab {a.vocab_size}, "
        f"{record['model']['params'] / 1e6:.1f}M params, fp32): {w['sequences']} sequences x "
        f"({w['prompt_len']} + {w['new_tokens']}) tokens, {args['threads']} threads"
    )
    baselines = [k for k in ("trl", "hf") if k in sides]
    print(f"baseline ran: {' and '.join(sides[k]['label'] for k in baselines)}")
    for name, side in sides.items():
        print(f"{name + ':':12} {_times(side)}")
    print(
        "tokens/s (sequences x new tokens / step, median): "
        + ", ".join(f"{name} {side['tokens_per_s']['median']:.0f}" for name, side in sides.items())
    )
    _print_limits(record)
    for name, ratio in record["ratios"].items():
        print(f"ratio {name} (per round): {_spread(ratio)}")
    for name, side in sides.items():
        print(f"{name} vs compute limit: {side['compute_limit_percent']:.0f}% of the limit")
    _print_phase_tables(sides, limits["phase_s"])
    sync = record["sync"]
    print(
        f"sync: {sync['bytes'] / 2**20:.1f} MiB in {sync['seconds'] * 1e3:.1f} ms = {sync['gb_per_s']:.2f} GB/s, "
        f"memcpy {sync['copy_gb_per_s']:.2f} GB/s ({sync['percent_of_copy']:.0f}% of it); last sync's steps: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sync["transition_steps_s"].items())
    )


def _print_limits(record: dict[str, Any]) -> None:
    flops, limits = record["limits"]["flops"], record["limits"]
    print(
        f"step FLOPs: generate {flops['generate'] / 1e9:.2f} G, log-probs (forward) "
        f"{flops['log_probs'] / 1e9:.2f} G, update (forward + backward) {flops['update'] / 1e9:.2f} G; "
        "LM head included"
    )
    if record["args"]["share_prompt_prefix"]:
        print(
            f"  ours computes update {flops['update_shared'] / 1e9:.2f} G of them (each prompt once per group, "
            "model.share_prompt_prefix); the limits count the workload's full FLOPs"
        )
    rates = limits["gemm_gflop_per_s"]
    print(
        f"torch.mm, best round: {rates['decode']:.1f} GFLOP/s at decode shapes, {rates['train']:.1f} GFLOP/s "
        "at training shapes (forward, input and weight gradients, LM head included); "
        f"Tensor.copy_ {limits['copy_gb_per_s']:.2f} GB/s"
    )
    print(f"compute limit of the step (generate + update): {limits['compute_s']:.3f}s")


def _print_phase_tables(sides: dict[str, Any], limits: dict[str, float]) -> None:
    names = list(sides)
    print("phase vs its own limit (median s, % of the limit):")
    print(f"  {'phase':10} {'limit':>9}" + "".join(f" {n:>20}" for n in names))
    for phase in PHASES:
        cells = []
        for name in names:
            seconds = sides[name]["phases_s"].get(phase, {}).get("median")
            percent = sides[name]["phase_limit_percent"].get(phase)
            cell = (
                "-"
                if seconds is None
                else f"{seconds:.3f}s" + (f" ({percent:.0f}%)" if percent is not None else "")
            )
            cells.append(f" {cell:>20}")
        limit = f"{limits[phase]:.3f}s" if phase in limits else "-"
        print(f"  {phase:10} {limit:>9}" + "".join(cells))
    with_rss = [n for n in names if sides[n]["peak_rss_mib"]]
    print("peak RSS per phase (MiB, the most of any timed round):")
    print(f"  {'phase':10}" + "".join(f" {n:>12}" for n in with_rss))
    for phase in PHASES:
        values = [sides[n]["peak_rss_mib"].get(phase) for n in with_rss]
        if any(v is not None for v in values):
            print(f"  {phase:10}" + "".join(f" {'-' if v is None else f'{v:.0f}':>12}" for v in values))


if __name__ == "__main__":
    main()
