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
heads, causal attention, the LM head wherever it runs) divided by the machine's faster fp32 GEMM rate
(``torch.mm`` or oneDNN's, ``bench._measure.mm_seconds``) at the phase's own GEMM shapes: decode shapes (one head GEMM per decode step) for ``generate``; forward, input-gradient and
weight-gradient shapes over the training tokens (the head over the response tokens) for ``update``
(forward + backward) and ``log_probs`` (forward only; only ``ours_always`` runs it), timed in this process
once per round beside the steps; the best round counts. Memory-bound phases, against ``Tensor.copy_``'s
bandwidth measured in the same run: ``sync`` (the bytes handed to the rollout engine, copied once) and
``optimizer`` (Adam's reads and writes). The compute limit of the step is generate + update, at the
workload's full FLOPs. Peak RSS per phase: the kernel's high-water mark, reset before each phase, on our
side and inside TRL's subprocess. Rounds alternate which side runs first (``--sides-in-turn``: each side's
steps back to back instead, ours with its host cache kept between them as a run keeps it, the baseline's
process started only after ours returned its cache); the report gives medians and the min-max spread;
``--json PATH`` writes all of it as one object. The FLOPs, GEMM shapes and limits are computed in
``bench/grpo_step_limits.py``, the report in ``bench/grpo_step_report.py``.

    python -m bench.bench_grpo_step --rounds 8 --threads 2 [--model realistic] [--baseline both] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench._measure import memcpy_bytes_per_s, peak_rss_bytes, reset_peak_rss
from bench.grpo_step_limits import WORKLOADS, GemmRate, gemm_shapes
from bench.grpo_step_report import print_report, report_record
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.local_hybrid import build_local_hybrid
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.shared_prefix import shared_prefix_packing
from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory
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

# the default --trl-python: the first that exists (``make trl-venv`` builds the first)
TRL_PYTHONS = (Path(__file__).parents[1] / ".venv-trl/bin/python", Path("/work/trl-venv/bin/python"))
TRL_PYTHON = next((p for p in TRL_PYTHONS if p.exists()), TRL_PYTHONS[0])
TRL_CHILD = Path(__file__).with_name("_trl_grpo.py")
LR = 1e-6  # every side's Adam learning rate
SPLIT = ("generate", "forward_backward", "optimizer")  # the baselines' step split, in order


def _hf_config(model: str = "tiny") -> dict[str, Any]:
    return dict(WORKLOADS[model]["hf_config"])


def _advantages(responses: torch.Tensor, group: int) -> torch.Tensor:
    """[N] group-normalised rewards of a fixed toy reward (share of even token ids)."""
    reward = (responses % 2 == 0).float().mean(dim=1).view(-1, group)
    return ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)


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
        # A cache emptied after every step keeps no logits, as mcore-rl train with trainer.host_cache_gib=0
        # (trainer/build.py): the kept block would be faulted in fresh every step.
        options = ModelOptions(keep_logits_bytes=0 if getattr(args, "return_host_cache", False) else None)
        self.engine = TrainEngine.build(self.arch, ctx, options, OptimConfig(weight_decay=0.0, lr=LR))
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

    def _micro_rows(self, rows: int, width: int) -> list[slice]:
        """The update's micro-batches as row ranges: whole prompt groups (so each prompt is still computed
        once per group), as many as fit ``--micro-batch-tokens`` (at least one group; all rows when unset), as
        ``algorithm.ppo_max_token_len_per_gpu`` splits a rank's update in ``mcore-rl train``."""
        budget, group = self.args.micro_batch_tokens, self.args.n
        step = rows if budget is None else group * max(1, budget // (group * width))
        return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]

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
        parts = self._micro_rows(*tokens.shape)
        if recompute:
            micro_old: list[MicroBatch] = [
                self._packed(LogProbMicroBatch(tokens[r], positions[r], mask=mask[r])) for r in parts
            ]
            old = self.engine.forward_backward(micro_old, log_prob_loss(vocab, 1.0), forward_only=True)
            settings, old_log_probs = self.settings, torch.cat([o.log_probs for o in old])
            clock.end("log_probs")
        adv = _advantages(out.token_ids, args.n)[:, None] * mask
        unread = torch.full(mask.shape, math.nan)  # the shortcut's loss never reads the old log-probs
        old_or_unread = unread if old_log_probs is None else old_log_probs
        zeros = torch.zeros_like(mask)
        micro: list[MicroBatch] = [
            self._packed(
                PolicyMicroBatch(
                    tokens[r],
                    positions[r],
                    train=TrainBatch(tokens[r], mask[r], old_or_unread[r], adv[r], zeros[r]),
                )
            )
            for r in parts
        ]
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
    parser.add_argument(
        "--release-host-memory",
        action="store_true",
        help="leave glibc's default (freed blocks returned to the system) instead of what a CPU rank does "
        "(mcore_rl/engine/workers/host_heap.py): the A/B of that policy",
    )
    parser.add_argument(
        "--return-host-cache",
        action="store_true",
        help="return the blocks our host cache kept after each of our steps (its cap back before the next): "
        "a 24 GiB machine cannot hold them and TRL's process at 512 new tokens (--sides-in-turn avoids that "
        "without emptying the cache between our steps)",
    )
    parser.add_argument(
        "--sides-in-turn",
        action="store_true",
        help="each side's warm-up and rounds back to back instead of interleaved: ours first, its host cache "
        "kept between its steps as a run keeps it, then returned, and only then TRL's process started "
        "(the scaling sweep: a 24 GiB machine holds one side's memory at 512 new tokens, not both)",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="split our update into micro-batches of whole prompt groups of at most this many tokens (at least "
        "one group; default: the whole batch in one), as algorithm.ppo_max_token_len_per_gpu does",
    )
    parser.add_argument("--json", type=Path, help="also write everything the report prints to this file")
    args = parser.parse_args()
    if args.return_host_cache and args.release_host_memory:
        parser.error("--return-host-cache: there is no cache to return with --release-host-memory")
    if args.sides_in_turn and (args.return_host_cache or args.release_host_memory):
        parser.error(
            "--sides-in-turn: keeps our host cache through our steps; "
            "drop --return-host-cache / --release-host-memory"
        )
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


def _returning_host_cache(
    step: Callable[[torch.Tensor, int], dict[str, float]],
) -> Callable[[torch.Tensor, int], dict[str, float]]:
    """``step`` with the host cache at its default cap while it runs and emptied after it (outside its
    timing): blocks freed and reused within the step are kept, none stay while another side runs."""

    def run(prompts: torch.Tensor, seed: int) -> dict[str, float]:
        keep_freed_host_memory()
        try:
            return step(prompts, seed)
        finally:
            keep_freed_host_memory(0)

    return run


def _baseline_sides(
    args: argparse.Namespace, prompts: torch.Tensor, labels: dict[str, str], stack: contextlib.ExitStack
) -> dict[str, Callable[[torch.Tensor, int], dict[str, float]]]:
    """The baseline steps ``--baseline`` names (TRL's subprocess closed with ``stack``)."""
    sides: dict[str, Callable[[torch.Tensor, int], dict[str, float]]] = {}
    if args.baseline in ("trl", "both"):
        trl = TrlBaseline(args.trl_python, prompts, args)
        stack.callback(trl.close)
        sides["trl"], labels["trl"] = trl.step, trl.label
    if args.baseline in ("hf", "both"):
        sides["hf"] = Baseline(args).step
        labels["hf"] = "HF generate + plain PyTorch GRPO step"
    return sides


def _measure(
    args: argparse.Namespace, ours: Ours, gemm: GemmRate, prompts: torch.Tensor, labels: dict[str, str]
) -> dict[str, list[dict[str, float]]]:
    """Every side's rounds: interleaved, or with ``--sides-in-turn`` ours' first and the baselines' after."""
    own: dict[str, Callable[[torch.Tensor, int], dict[str, float]]] = {"ours": ours.step}
    if not args.no_always:
        own["ours_always"] = functools.partial(ours.step, recompute=True)
    if args.return_host_cache:
        own = {name: _returning_host_cache(step) for name, step in own.items()}
    probe = {"gemm": gemm.step}
    with contextlib.ExitStack() as stack:
        if not args.sides_in_turn:
            sides = own | probe | _baseline_sides(args, prompts, labels, stack)
            return _run_rounds(sides, prompts, args.rounds, unwarmed=("gemm",))
        rows = _run_rounds(own, prompts, args.rounds)
        keep_freed_host_memory(0)  # our kept blocks go back before the baseline's process starts
        rows |= _run_rounds(probe, prompts, args.rounds, unwarmed=("gemm",))
        return rows | _run_rounds(_baseline_sides(args, prompts, labels, stack), prompts, args.rounds)


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    if (
        not args.release_host_memory
    ):  # as a CPU rank does in Worker.init_parallel; TRL runs in its own process
        print(keep_freed_host_memory())
    torch.manual_seed(0)
    prompts = torch.randint(1, args.hf_config["vocab_size"], (args.prompts, args.prompt_len))
    labels = {"ours": "ours", "ours_always": "ours, recompute_old_log_probs=always"}
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        ours = Ours(ctx, args)
        gemm = GemmRate(gemm_shapes(ours.arch, args.prompts * args.n, args.prompt_len, args.new_tokens))
        rows = _measure(args, ours, gemm, prompts, labels)
        last_sync = next(t for t in reversed(ours.hybrid.history) if t.target.value == "rollout")
        sync = {"bytes": ours.sync_bytes, "steps_s": last_sync.steps_s}
    sync["copy_bytes_per_s"] = memcpy_bytes_per_s(ours.sync_bytes)
    del rows["gemm"]
    record = report_record(args, ours.arch, rows, labels, gemm.best, sync)
    print_report(record)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
