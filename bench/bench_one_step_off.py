"""One-step-off placements of a GRPO step through the Ray driver, measured in one run: the step time of

  - ``colocated``: on-policy, the rollout engine in the actor's process (the hybrid engine), all CPUs;
  - ``colocated_off``: one-step-off on the same ranks (the next rollout is generated before the update, one
    after the other: the data flow of one-step-off without its overlap);
  - ``pool_off``: one-step-off with a rollout pool of its own (``rollout.colocate=false``): the actor and the
    pool get half of the CPUs each and the next rollout samples on the pool while the actor updates.

Each placement is a fresh run of the demo recipe without SFT on a wider model (hidden 256, 4 layers, 16 prompts
x 8 samples, ``--response-length`` new tokens); placements alternate in blocks of ``--steps`` (after ``--warmup`` unmeasured steps)
for ``--rounds`` rounds, so load from other processes hits them alike. The report gives per-placement medians
of the driver's step time (the sum of its stages, ``time/step_s``) with the min-max spread, the stage split,
and the ratios against ``colocated``.

    python -m bench.bench_one_step_off [--rounds 2] [--steps 6] [--warmup 2] [--cpus 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

PLACEMENTS = {
    "colocated": [],
    "colocated_off": ["trainer.one_step_off=true"],
    "pool_off": ["trainer.one_step_off=true", "rollout.colocate=false", "rollout.num_ranks=1"],
}
STAGES = ("generate", "generate_next", "generate_wait", "score_and_log_probs", "update", "sync", "step")


def run_block(placement: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """``--warmup + --steps`` steps of a fresh run; the measured steps' ``time/*`` in seconds."""
    from mcore_rl.trainer.trainer import Trainer

    overrides = [
        "sft.enable=false",
        "data.val_files=[]",
        "data.test_files=[]",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        f"trainer.num_cpus={args.cpus}",
        f"trainer.default_local_dir={tempfile.mkdtemp(prefix='bench_one_step_off_')}",
        "model.hf_config.hidden_size=256",
        "model.hf_config.intermediate_size=688",
        "model.hf_config.num_hidden_layers=4",
        f"data.max_response_length={args.response_length}",
        f"model.hf_config.max_position_embeddings={args.response_length + 16}",
        "logging.progress_bar=false",
        "logging.plot=false",
        *PLACEMENTS[placement],
    ]
    with Trainer.from_config("recipes/demo_cpu.yaml", overrides) as trainer:
        trainer.fit()
        records = [r for r in trainer.records if r["stage"] == "rl"][args.warmup :]
    return [{k[5:-2]: v for k, v in r.items() if k.startswith("time/")} for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps at the start of each block")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    parser.add_argument(
        "--response-length",
        type=int,
        default=16,
        help="new tokens per response (random weights: most reach it)",
    )
    args = parser.parse_args()
    seconds: dict[str, list[dict[str, float]]] = {p: [] for p in PLACEMENTS}
    for round_index in range(args.rounds):
        order = list(PLACEMENTS) if round_index % 2 == 0 else list(reversed(PLACEMENTS))
        for placement in order:
            seconds[placement] += run_block(placement, args)
    print(
        f"GRPO step through the Ray driver, {args.cpus} CPUs, {args.response_length} new tokens; "
        f"medians of {args.rounds} x {args.steps} steps (s)"
    )
    print(f"{'stage':<22}" + "".join(f"{p:>15}" for p in PLACEMENTS))
    for stage in STAGES:
        row = [statistics.median(s.get(stage, 0.0) for s in seconds[p]) for p in PLACEMENTS]
        print(f"{stage:<22}" + "".join(f"{v:>15.4f}" for v in row))
    base = statistics.median(s["step"] for s in seconds["colocated"])
    for placement in list(PLACEMENTS)[1:]:
        steps = [s["step"] for s in seconds[placement]]
        print(
            f"{placement}: step {statistics.median(steps):.4f} s (min {min(steps):.4f}, max {max(steps):.4f}); "
            f"colocated/{placement} = {base / statistics.median(steps):.2f}x"
        )


if __name__ == "__main__":
    main()
