"""PPO stage overlap: scoring, critic values and actor/reference log-probs one after another vs together.

After each rollout the three stages read only the rollout, so the driver can start them together
(``trainer.overlap_stages``). Here the critic runs on its own Ray pool (``critic.colocate=false``) so its
value pass can really run beside the actor's log-prob pass. One run, one set of workers: steps alternate
overlap off / on (load from other processes hits both alike); per-stage medians and the step-time ratio are
printed. Overlap changes no number (tests/trainer/test_ppo_ray.py); only the wall time can differ.

Workload: the PPO demo recipe (no SFT) on a wider model (hidden 256, 4 layers, vocab 14), 16 prompts x 8
samples; actor 1 rank, critic 1 rank, each with half of ``--cpus``.

    python bench/bench_ppo_overlap.py [--steps 6] [--warmup 2] [--cpus 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

STAGES = ("generate", "log_probs", "values", "score", "score_values_and_log_probs", "critic_update", "update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per mode first")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (shared by both pools)")
    args = parser.parse_args()

    from mcore_rl.trainer.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_ppo_overlap_")
    overrides = [
        "sft.enable=false",
        "data.test_files=[]",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.num_cpus={args.cpus}",
        f"trainer.default_local_dir={run_dir}",
        "critic.colocate=false",
        "critic.num_ranks=1",
        "critic.warmup_steps=0",
        "model.hf_config.hidden_size=256",
        "model.hf_config.intermediate_size=688",
        "model.hf_config.num_hidden_layers=4",
        "logging.progress_bar=false",
        "logging.plot=false",
    ]
    seconds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with Trainer.from_config("recipes/ppo_demo_cpu.yaml", overrides) as trainer:
        step, loader = trainer.step, trainer.data.loader
        for index in range(2 * (args.warmup + args.steps)):
            overlap = index % 2 == 1
            step.cfg.trainer.overlap_stages = overlap  # read by every step: toggles between steps
            metrics = step.run(loader.next_batch(), index + 1).metrics()
            if index // 2 >= args.warmup:
                seconds[overlap].append({k[5:-2]: v for k, v in metrics.items() if k.startswith("time/")})
    print(f"PPO step, critic on its own pool; median of {args.steps} steps per mode (seconds)")
    print(f"{'stage':<28}{'overlap off':>12}{'overlap on':>12}")
    for stage in (*STAGES, "step"):
        row = [statistics.median(s.get(stage, 0.0) for s in seconds[mode]) for mode in (False, True)]
        print(f"{stage:<28}{row[0]:>12.4f}{row[1]:>12.4f}")
    off, on = (statistics.median(s["step"] for s in seconds[mode]) for mode in (False, True))
    after = [statistics.median(s["score_values_and_log_probs"] for s in seconds[m]) for m in (False, True)]
    print(f"after-rollout stages: off/on = {after[0] / after[1]:.2f}x; whole step: off/on = {off / on:.2f}x")


if __name__ == "__main__":
    main()
