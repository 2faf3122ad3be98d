"""The one naming of megatron parameters that the reshard plan, its executor and the engines share.

A rank's model chunks name their parameters locally (layer numbers restart in every chunk, Transformer-Engine
fuses the norms into the next linear, and with tied embeddings the last pipeline stage holds its copy of the
embedding as ``output_layer.weight``). The *canonical key* of a parameter is its full-state name: global layer
number, local-spec suffix, and every copy of a tied weight under the one key of the weight it copies. Two
functions define it, and nothing else renames parameters:

- :func:`canonical_key`: chunk-local name -> key (what ``engine.weights.local_parameters`` yields);
- :func:`holder_stages`: key -> the pipeline stages that hold a copy (what the plan takes its sources from).

Keeping both here is what makes "every holder of a weight is planned and found under the same key" true by
construction: the tied copy is planned as a second source of the embedding *and* reported under that key.
"""

from __future__ import annotations

from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.parallel.sharding import global_param_name

EMBEDDING_KEY = "embedding.word_embeddings.weight"
OUTPUT_KEY = "output_layer.weight"


def canonical_key(local_name: str, layer_offset: int, *, tied: bool, expert_offset: int = 0) -> str:
    """The key of chunk-local parameter ``local_name`` whose chunk starts at global layer ``layer_offset``.

    ``tied``: the model shares its embedding with the output layer (``tie_word_embeddings`` and no value
    head). megatron then allocates no output weight where the embedding lives (pipeline size 1, or the first
    stage) and a synchronised copy named ``output_layer.weight`` on the last stage: that copy is the embedding.
    ``expert_offset``: the global index of this rank's first expert (MoE; ``ParallelLayout.local_experts``).
    """
    name = global_param_name(local_name, layer_offset, expert_offset)
    return EMBEDDING_KEY if tied and name == OUTPUT_KEY else name


def holder_stages(
    key: str, layer: int | None, train: ParallelLayout, num_layers: int, tied: bool
) -> set[int]:
    """Pipeline stages whose ranks hold a (TP shard of a) copy of ``key``; ``layer`` is its global layer, if any.

    With ``tied`` the embedding has two holders (first and last stage; one when the pipeline has one stage),
    matching :func:`canonical_key`, which reports the last stage's copy under the embedding's key.
    """
    if layer is not None:
        stages = train.stage_layers(num_layers)
        return {p for p, chunks in enumerate(stages) if any(layer in r for r in chunks)}
    if key == EMBEDDING_KEY:
        return {0, train.pp - 1} if tied else {0}
    return {train.pp - 1}
