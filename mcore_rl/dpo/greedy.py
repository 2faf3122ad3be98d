"""Greedy answers of the policy on held-out prompts, scored by the run's reward rules (exact match for the demo).

Generation runs on the embedded rollout engine behind the 3D-HybridEngine (the same reshard the RL trainer
uses), so it works at any training layout: each rollout replica answers its share of the prompts, the
answers are gathered, and rank 0 scores them and shares the mean.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mcore_rl.config import RunConfig
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.types import PromptBatch


class GreedyScorer:
    """Builds the rollout side on first use (collective); :meth:`accuracy` is collective too."""

    def __init__(self, cfg: RunConfig, engine: TrainEngine, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self._stops = list(dict.fromkeys([tokenizer.eos_token_id, *cfg.model.generation_stop_ids()]))
        """The tokenizer's EOS and the model's own (``generation_config.json``), read once."""
        self._hybrid: Any = None
        self._rollout: Any = None
        self._scorer: Any = None

    def accuracy(self, prompts: PromptBatch) -> float:
        """Mean score of the greedy answers to ``prompts`` (every rank gets it)."""
        from mcore_rl.engine.rollout.base import SamplingParams

        ctx = self.engine.ctx
        if self._hybrid is None:
            from mcore_rl.engine.local_hybrid import build_local_hybrid

            self._hybrid, self._rollout = build_local_hybrid(
                self.engine, self.cfg.rollout.tensor_model_parallel_size
            )
        tp_g, replica = self._hybrid.plan.rollout_coords[ctx.rank]
        replicas = ctx.world_size // self.cfg.rollout.tensor_model_parallel_size
        mine = list(range(replica, len(prompts), replicas))
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=self.cfg.data.max_response_length,
            stop_token_ids=self._stops,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        self._hybrid.to_rollout()
        try:
            out = self._rollout.generate([prompts.prompt_ids[i] for i in mine], params) if mine else None
        finally:
            self._hybrid.to_train()
        answers: dict[int, str] = {}
        if out is not None and tp_g == 0:
            answers = {i: self.tokenizer.decode(r) for i, r in zip(mine, out.responses(), strict=True)}
        gathered: list[dict[int, str] | None] = [None] * ctx.world_size
        dist.all_gather_object(gathered, answers)
        result = [self._score(gathered, prompts) if ctx.rank == 0 else 0.0]
        dist.broadcast_object_list(result, src=0)
        return float(result[0])

    def _score(self, gathered: list[dict[int, str] | None], prompts: PromptBatch) -> float:
        from mcore_rl.scoring import RewardScorer, ScoreRequest

        answers: dict[int, str] = {}
        for part in gathered:
            answers.update(part or {})
        if sorted(answers) != list(range(len(prompts))):
            raise RuntimeError(f"greedy evaluation lost answers: got {len(answers)} of {len(prompts)}")
        if self._scorer is None:
            self._scorer = RewardScorer(self.cfg.reward)
        requests = [
            ScoreRequest(
                prompts.data_sources[i], answers[i], prompts.ground_truths[i], prompts.extra_infos[i]
            )
            for i in range(len(prompts))
        ]
        return float(self._scorer.score(requests).scores.float().mean())

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
