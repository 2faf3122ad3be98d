"""The demo's GRPO stage: batch assembly (pure) and two real steps on a TP2 actor with the hybrid engine."""

from __future__ import annotations

import math

import torch

from mcore_rl.data.arithmetic import AdditionProblem, CharTokenizer, make_problems
from mcore_rl.demo_grpo import GRPOConfig, build_hybrid, grpo_step, train_batch
from mcore_rl.engine.rollout import GenerationOutput
from mcore_rl.engine.train_engine import OptimizerConfig, TrainEngine
from mcore_rl.parallel.context import ParallelConfig, ParallelContext
from tests.models import tiny_arch


def test_train_batch_puts_every_response_quantity_on_the_position_that_predicts_it() -> None:
    prompts = [[5, 6, 7], [8, 9]]
    out = GenerationOutput(
        prompt_index=torch.tensor([0, 1]),
        token_ids=torch.tensor([[20, 21, 22], [30, 0, 0]]),
        log_probs=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]),
        lengths=torch.tensor([3, 1]),
        finish_reasons=["length", "stop"],
    )
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    batch = train_batch(prompts, out, advantages, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 20, 21, 22], [8, 9, 30, 0, 0, 0]]
    assert batch.extras["labels"][0, 2:5].tolist() == [20, 21, 22]  # position 2 predicts the first response
    assert batch.extras["mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]]
    assert torch.allclose(batch.extras["old_log_probs"][0, 2:5], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.extras["old_log_probs"][1, 1] == -0.4 and batch.extras["advantages"][1, 1] == -2.0
    assert batch.extras["advantages"][0].tolist() == [0, 0, 1, 1, 1, 0]


def _two_grpo_steps() -> list[dict[str, float]]:
    arch = tiny_arch("llama")
    tokenizer = CharTokenizer()
    with ParallelContext.initialize(ParallelConfig(tensor_parallel_size=2)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=OptimizerConfig(lr=1e-3))
        hybrid, rollout = build_hybrid(engine)
        config = GRPOConfig(prompts_per_step=4, samples_per_prompt=4)

        # A random model never adds correctly; this verifier gives mixed rewards, hence a real update.
        def starts_with_a_small_digit(completion: str, problem: AdditionProblem) -> float:
            return float(completion[:1] in "01234")

        problems = make_problems(4, seed=0)
        return [
            grpo_step(
                hybrid, rollout, problems, tokenizer, config, seed=step, verifier=starts_with_a_small_digit
            )
            for step in range(2)
        ]


def test_grpo_steps_on_a_tp2_actor_are_on_policy(run_distributed) -> None:
    """Resharding TP2 -> rollout TP1, sampling, verifying and one PPO update, twice: the rollout log-probs
    are the actor's (the first PPO ratio is 1, so the estimated KL is at rounding level) on every rank."""
    for metrics in run_distributed(_two_grpo_steps, world_size=2):
        for step in metrics:
            assert abs(step["approx_kl"]) < 1e-6 and step["clip_frac"] == 0.0
            assert 0.0 <= step["reward"] <= 1.0 and math.isfinite(step["pg_loss"])
            assert 0.0 < step["reward"] < 1.0 and step["grad_norm"] > 0 and step["response_len"] >= 1
