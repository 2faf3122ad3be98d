"""Faults injected into a Ray run of the demo recipe, and what recovery costs (issue 31), in one run:

  - ``baseline``: the run without faults (the same Ray driver and layout), timed;
  - ``faulted``: the same run with one rank SIGKILLed during each step of ``--kill-steps`` (its process gone, as
    the OOM killer or a lost node leaves it); the driver restarts the worker groups, loads the last run
    checkpoint (``trainer.save_freq``) and continues (``trainer.max_restarts``).

For each fault it reports the steps run again (those after the checkpoint), the seconds from the fault being
noticed to the workers ready with the checkpoint loaded (the driver's ``recovery_s``), the seconds from the kill
itself to training again, and whether the faulted run's every RL metric equals the baseline's (same seeds:
exactly, or the recovery changed the run). The ratio is the faulted run's wall time over the baseline's.

    python -m bench.bench_faults [--steps 10] [--save-freq 2] [--kill-steps 3,6,9] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from typing import Any

TIMING = ("time/", "tokens_per_s", "memory/")


def run(args: argparse.Namespace, folder: str, kill_steps: set[int]) -> dict[str, Any]:
    """One run of the recipe in ``folder``, killing rank ``--kill-rank`` during each step of ``kill_steps``."""
    from mcore_rl.trainer.trainer import Trainer

    overrides = [
        "sft.enable=false",
        "data.val_files=[]",
        "data.test_files=[]",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "logging.progress_bar=false",
        "logging.plot=false",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.save_freq}",
        f"trainer.max_restarts={len(kill_steps)}",
        f"trainer.n_gpus_per_node={args.ranks}",
        f"trainer.num_cpus={args.cpus}",
        f"trainer.default_local_dir={folder}",
        "data.generate=arithmetic_reversed",
        f"data.train_files=[{args.data}/train.parquet]",
        f"sft.train_files=[{args.data}/sft.parquet]",
        f"model.tokenizer_path={args.data}/tokenizer",
    ]
    kills: list[float] = []
    start = time.perf_counter()
    with Trainer.from_config("recipes/demo_cpu.yaml", overrides) as trainer:
        scorer_score = trainer.scorer.score  # the scorer outlives the worker groups a recovery replaces
        done: set[int] = set()

        def score_and_kill(requests: Any) -> Any:
            step = trainer.global_step
            if step in kill_steps and step not in done:
                done.add(step)
                pids = trainer.actors.backend.group.run("pid")  # type: ignore[attr-defined]
                os.kill(pids[args.kill_rank], signal.SIGKILL)
                kills.append(time.time())
            return scorer_score(requests)

        trainer.scorer.score = score_and_kill  # type: ignore[assignment, method-assign]
        trainer.fit()
        records = trainer.records
    seconds = time.perf_counter() - start
    metrics = [
        {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records if r["stage"] == "rl"
    ]
    recoveries = [r for r in records if r["stage"] == "recovery"]
    return {"seconds": seconds, "metrics": metrics, "recoveries": recoveries, "kills": kills}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--kill-steps", default="3,6,9", help="RL steps during which a rank is killed")
    parser.add_argument("--ranks", type=int, default=2, help="actor ranks (data-parallel)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    kill_steps = {int(s) for s in args.kill_steps.split(",") if s}
    with tempfile.TemporaryDirectory(prefix="bench_faults_") as root:
        args.data = os.path.join(root, "data")
        baseline = run(args, os.path.join(root, "baseline"), set())
        faulted = run(args, os.path.join(root, "faulted"), kill_steps)
    print(
        f"{args.steps} RL steps, {args.ranks} ranks, a checkpoint every {args.save_freq} steps, rank "
        f"{args.kill_rank} killed (SIGKILL) during steps {sorted(kill_steps)}"
    )
    print("| fault | lost in | step | resumed from | steps run again | recovery_s | kill -> training s |")
    print("|---|---|---|---|---|---|---|")
    for i, (record, killed) in enumerate(zip(faulted["recoveries"], faulted["kills"], strict=False), 1):
        print(
            f"| {i} | {record['phase']} | {record['failed_at_step']} | {record['step']} | {record['steps_lost']} | "
            f"{record['recovery_s']:.1f} | {record['unix_time'] - killed:.1f} |"
        )
    same = faulted["metrics"] == baseline["metrics"]
    print(
        f"faults injected {len(faulted['kills'])}, recovered {len(faulted['recoveries'])}, "
        f"steps run again {sum(r['steps_lost'] for r in faulted['recoveries'])}; every RL metric equal to the "
        f"run without faults: {same}"
    )
    print(
        f"wall time: baseline {baseline['seconds']:.1f} s, faulted {faulted['seconds']:.1f} s "
        f"({faulted['seconds'] / baseline['seconds']:.2f}x)"
    )


if __name__ == "__main__":
    main()
