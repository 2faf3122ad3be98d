"""Rollout output as position-aligned records: an engine's :class:`GenerationOutput` joined with its prompts
(:func:`rollout_batch`), and the replicas' shards padded to one width so that they concatenate
(:func:`common_width`). Pure tensor code; see :mod:`mcore_rl.types` for the position alignment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mcore_rl.engine.rollout.base import GenerationOutput
from mcore_rl.types import RolloutBatch


def rollout_batch(
    prompt_ids: Sequence[Sequence[int]], prompt_index: Tensor, out: GenerationOutput, pad_id: int
) -> RolloutBatch:
    """Join prompts and sampled responses into position-aligned rows, without a per-row Python loop.

    ``prompt_ids[j]`` is the j-th prompt given to the engine and ``prompt_index[j]`` its number in the step;
    ``out.prompt_index`` says which j each sequence continues.
    """
    local = out.prompt_index.long()
    lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    prompt_len = lengths[local]  # [N]
    num, new = out.token_ids.shape
    width = int(lengths.max()) + new
    padded = torch.full((len(prompt_ids), int(lengths.max())), pad_id, dtype=torch.long)
    for j, ids in enumerate(prompt_ids):  # once per prompt, not per sample
        padded[j, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    tokens = torch.full((num, width), pad_id, dtype=torch.long)
    tokens[:, : padded.shape[1]] = padded[local]
    steps = torch.arange(new)
    valid = steps[None, :] < out.lengths[:, None]  # [N, T]
    columns = prompt_len[:, None] + steps[None, :]  # where response token j sits
    tokens.scatter_(1, columns, torch.where(valid, out.token_ids, pad_id))
    mask = torch.zeros(num, width).scatter_(1, columns - 1, valid.float())
    log_probs = torch.zeros(num, width).scatter_(1, columns - 1, torch.where(valid, out.log_probs, 0.0))
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        rollout_log_probs=log_probs,
        response_ids=torch.where(valid, out.token_ids, pad_id),
        response_lengths=out.lengths.long(),
        prompt_index=prompt_index.long()[local],
        expert_choices=_expert_choices(out, local, lengths, columns, width),
    )


def _expert_choices(
    out: GenerationOutput, local: Tensor, lengths: Tensor, columns: Tensor, width: int
) -> Tensor | None:
    """[N, S, L, k] int16 of the recorded routing, position-aligned like the tokens; -1 elsewhere."""
    if out.prompt_experts is None or out.response_experts is None:
        return None
    layers, k = out.response_experts.shape[2:]
    prompts = torch.full((len(out.prompt_experts), int(lengths.max()), layers, k), -1, dtype=torch.int16)
    for j, experts in enumerate(out.prompt_experts):
        prompts[j, : experts.shape[0]] = experts
    choices = torch.full((local.shape[0], width, layers, k), -1, dtype=torch.int16)
    choices[:, : prompts.shape[1]] = prompts[local]
    index = columns[:, :, None, None].expand(-1, -1, layers, k)
    return choices.scatter_(1, index, out.response_experts.to(torch.int16))


def common_width(batches: Sequence[RolloutBatch], pad_id: int) -> list[RolloutBatch]:
    """The rollout shards of several replicas, right-padded to the widest one's ``S`` and ``T`` so that they
    concatenate: replicas see prompts of other lengths and stop after other numbers of tokens."""
    seq = max(b.tokens.shape[1] for b in batches)
    new = max(b.response_ids.shape[1] for b in batches)

    def pad(t: Tensor, width: int, value: float) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return [
        RolloutBatch(
            tokens=pad(b.tokens, seq, pad_id),
            response_mask=pad(b.response_mask, seq, 0.0),
            rollout_log_probs=pad(b.rollout_log_probs, seq, 0.0),
            response_ids=pad(b.response_ids, new, pad_id),
            response_lengths=b.response_lengths,
            prompt_index=b.prompt_index,
            expert_choices=None
            if b.expert_choices is None
            else torch.nn.functional.pad(
                b.expert_choices, (0, 0, 0, 0, 0, seq - b.tokens.shape[1]), value=-1
            ),
        )
        for b in batches
    ]
