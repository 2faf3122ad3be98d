"""TRL's ``GRPOTrainer`` step as a persistent subprocess, the named baseline of ``bench/bench_grpo_step.py``.

Runs under a separate interpreter that has TRL installed (``/work/trl-venv``: installing TRL into the project
venv is not allowed to change torch), so this file imports only TRL's own stack, never ``mcore_rl``.

Protocol (one JSON object a line): the parent starts ``python bench/_trl_grpo.py --spec JSON`` and reads a
``{"ready": ...}`` line; then each ``step`` on stdin runs exactly one training step and answers
``{"step": s, "generate": s, "forward_backward": s, "optimizer": s, "peak_rss": {phase: bytes}, ...}``;
``quit`` (or EOF) ends the process.
The protocol goes through a private copy of the original stdout; ``sys.stdout`` and fd 1 are pointed at
stderr, so anything TRL or transformers print cannot corrupt it.

How a step is timed, and why it is TRL's real step: ``trainer.train()`` runs unmodified; a callback blocks on
stdin in ``on_train_begin`` and ``on_step_end``, so each ``step`` command releases exactly one iteration of
transformers' training loop: the previous step's (disabled) log/save/eval check, the dataloader batch, GRPO's
``training_step`` (``_prepare_inputs`` -> ``_generate_and_score_completions``: ``model.generate``, the reward,
group advantages; then ``compute_loss`` and backward), gradient clipping, ``optimizer.step()``, the LR
scheduler, ``zero_grad``. Calling the trainer's methods by hand would leave out whatever glue the loop adds;
blocking inside it leaves out nothing but the wait. The split wraps the real methods with timers:
``generate`` = ``_generate_and_score_completions`` (sampling + reward + advantages), ``forward_backward`` =
the rest of the step up to ``on_pre_optimizer_step`` (includes the dataloader fetch and grad clipping),
``optimizer`` = ``optimizer.step()`` to ``on_step_end`` (LR scheduler, ``zero_grad``). Peak RSS per phase:
the kernel's high-water mark (VmHWM), reset at the step's start, read and reset when generation ends
(``generate``, the dataloader fetch included) and at ``on_pre_optimizer_step`` (``forward_backward``), read
at ``on_step_end`` (``optimizer``).

Settings that differ from GRPOConfig's defaults, each to match the bench's workload: ``bf16=False`` (fp32),
``activation_checkpointing=False`` (no step here recomputes activations), ``shuffle_dataset=False`` with the
dataset being the bench's 8 prompts tiled (every step sees exactly those prompts), ``min_new_tokens`` =
``max_completion_length`` (exactly that many new tokens: EOS is masked until then), ``top_k=0`` /
``top_p=1`` / temperature 1 (plain sampling), ``optim="adamw_torch"`` with ``weight_decay=0`` and a
constant LR of the bench's value (= Adam). Already the defaults: ``beta=0`` (no reference model),
``num_iterations=1`` and ``steps_per_generation`` = gradient accumulation = 1, so TRL skips the old-log-prob
forward like our on-policy shortcut; ``loss_type="dapo"``; ``max_grad_norm=1.0`` (kept: it is TRL's step).
The RNG is seeded once at start (TRL's ``seed``), not per step as the in-process baselines do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

# Point fd 1 at stderr before importing anything that might print; keep a private handle for the protocol.
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # nothing is downloaded: model, tokenizer and data are built here
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import trl  # noqa: E402
from _measure import peak_rss_bytes, reset_peak_rss  # noqa: E402  (bench/ is this script's sys.path[0])
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)

EOS = "<eos>"  # id 0: also the pad token; the bench's prompts never hold it and generation masks it
MODEL_SHAPE = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""The model's config fields the ready line reports, for the parent to check against the config it sent."""
MAX_STEPS = 4096  # an upper bound on steps one bench run asks for; the dataset holds this many batches


def _send(obj: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(obj) + "\n")


def _tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer whose word ``t<i>`` is token id ``i``: a prompt text maps to exactly its ids."""
    vocab = {EOS: 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=EOS, unk_token=EOS, padding_side="left"
    )


def even_share_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The bench's toy reward: the share of even token ids in each completion."""
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) for ids in completion_ids]


class _Timer(TrainerCallback):
    """Blocks the training loop on stdin between steps and reports each step's wall time and split."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir  # ours to remove: the quit below skips the TemporaryDirectory's exit
        self.marks: dict[str, float] = {}
        self.generate_s = 0.0
        self.peak_rss: dict[str, int] = {}  # phase -> bytes, this step's
        self.num_completions = 0  # completions scored in this step, counted by the reward function's caller
        self.metrics: Any = None  # the trainer's ``_metrics``, set once the trainer exists

    def wait_for_command(self) -> None:
        line = sys.stdin.readline().strip()
        if line in ("", "quit"):
            _PROTOCOL.flush()
            shutil.rmtree(self.output_dir, ignore_errors=True)
            os._exit(0)  # skip the trainer's end-of-training work: nothing of it is measured
        if line != "step":
            raise SystemExit(f"_trl_grpo: unknown command {line!r} (expected 'step' or 'quit')")
        self.generate_s, self.num_completions, self.peak_rss = 0.0, 0, {}
        reset_peak_rss()
        self.marks = {"start": time.perf_counter()}

    def phase_end(self, phase: str) -> None:
        """Records ``phase``'s peak RSS and starts the next phase's."""
        self.peak_rss[phase] = peak_rss_bytes()
        reset_peak_rss()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.wait_for_command()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks["pre_optimizer"] = time.perf_counter()
        self.phase_end("forward_backward")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        end, m = time.perf_counter(), self.marks
        self.phase_end("optimizer")
        lengths = self.metrics["train"]  # TRL's own per-step record of the completions it trained on
        _send(
            {
                "step": end - m["start"],
                "generate": self.generate_s,
                "forward_backward": m["pre_optimizer"] - m["start"] - self.generate_s,
                "optimizer": end - m["pre_optimizer"],
                "completion_len_min": lengths["completions/min_length"][-1],
                "completion_len_max": lengths["completions/max_length"][-1],
                "num_completions": self.num_completions,
                "peak_rss": self.peak_rss,
            }
        )
        self.wait_for_command()


def _config(spec: dict[str, Any], output_dir: str) -> trl.GRPOConfig:
    completions = spec["prompts_per_step"] * spec["num_generations"]
    return trl.GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,  # TRL's default is on; transformers 5 renamed gradient_checkpointing
        per_device_train_batch_size=completions,  # GRPO counts completions, not prompts
        gradient_accumulation_steps=1,
        num_generations=spec["num_generations"],
        max_completion_length=spec["new_tokens"],
        generation_kwargs={"min_new_tokens": spec["new_tokens"]},
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        shuffle_dataset=False,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_steps=MAX_STEPS,
        seed=spec["seed"],
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def build_trainer(spec: dict[str, Any], output_dir: str) -> tuple[trl.GRPOTrainer, _Timer]:
    """The GRPO trainer over the bench's model and prompts, with the step timer attached."""
    torch.manual_seed(spec["seed"])
    # LlamaConfig's default eos id (2) would be a second stop id: the tokenizer's id 0 is the only one
    special = {"eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None}
    model = LlamaForCausalLM(LlamaConfig(**{**spec["hf_config"], **special}))  # random init, fp32
    tokenizer = _tokenizer(spec["hf_config"]["vocab_size"])
    texts = [" ".join(f"t{i}" for i in ids) for ids in spec["prompts"]]
    if any(0 in ids for ids in spec["prompts"]):
        raise SystemExit("_trl_grpo: spec.prompts must not hold token id 0 (the EOS/pad id)")
    dataset = Dataset.from_dict({"prompt": texts * MAX_STEPS})
    timer = _Timer(output_dir)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=even_share_reward,
        args=_config(spec, output_dir),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs: Any) -> Any:
        start = time.perf_counter()
        out = generate_and_score(inputs)
        timer.generate_s += time.perf_counter() - start
        timer.phase_end("generate")
        timer.num_completions += len(out["completion_ids"])
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    timer.metrics = trainer._metrics
    return trainer, timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON: hf_config, prompts, num_generations, ...")
    spec = json.loads(parser.parse_args().spec)
    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as output_dir:
        trainer, _ = build_trainer(spec, output_dir)
        _send(
            {  # what the parent checks against its own run before timing anything
                "ready": True,
                "trl": trl.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "mixed_precision": str(trainer.accelerator.mixed_precision),
                "activation_checkpointing": trainer.model.is_activation_checkpointing,
                "dtype": str(next(trainer.model.parameters()).dtype),
                "model": {k: getattr(trainer.model.config, k) for k in MODEL_SHAPE},
            }
        )
        trainer.train()
    raise SystemExit(f"_trl_grpo: training ended after max_steps={MAX_STEPS}")


if __name__ == "__main__":
    main()
