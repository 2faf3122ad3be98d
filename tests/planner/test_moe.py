"""The planner on mixture-of-experts models: parameter counts against the model cards, what one rank holds
under TP/PP/EP/ETP, the MoE memory terms against hand-computed cases, and the expert splits the search
tries and refuses."""

from __future__ import annotations

import math

import pytest

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.params import active_params, model_params, stage_split
from mcore_rl.engine.rollout.layout import rollout_param_shapes
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.planner import PlanError, PlanInput, plan_memory, smallest_fitting_layout
from mcore_rl.planner.moe import rollout_weight_numel
from mcore_rl.planner.report import format_plan
from mcore_rl.planner.search import _expert_splits
from mcore_rl.planner.selfcheck import RankBytes, check_rank
from tests.models import tiny_arch
from tests.planner.hf_configs import MIXTRAL_8X7B, QWEN3_30B_A3B

GIB = 1 << 30
QWEN3_MOE = ModelArch.from_hf_config(QWEN3_30B_A3B)
MIXTRAL = ModelArch.from_hf_config(MIXTRAL_8X7B)

# Qwen3-30B-A3B, per layer: attention (4096 + 2 * 512) * 2048 + 2048 * 4096 = 18,874,368, norms 2 * 2048, q/k
# norms 2 * 128, router 128 * 2048 = 262,144; one expert 3 * 768 * 2048 = 4,718,592.
QWEN_ATTENTION, QWEN_EXPERT = 18_874_368, 4_718_592


def test_qwen3_30b_a3b_counts_match_its_model_card():
    # 30.5B total, 3.3B activated, 29.9B without the embedding and output layer (151,936 x 2048 each).
    layer = QWEN_ATTENTION + 4096 + 256 + 262_144 + 128 * QWEN_EXPERT
    assert model_params(QWEN3_MOE) == 48 * layer + 2 * 151_936 * 2048 + 2048 == 30_532_122_624
    assert model_params(QWEN3_MOE) - 2 * 151_936 * 2048 == 29_909_792_768  # "Non-Embedding: 29.9B"
    # Active: every dense weight, the router, 8 of the 128 experts.
    assert active_params(QWEN3_MOE) == 30_532_122_624 - 48 * 120 * QWEN_EXPERT == 3_353_032_704


def test_mixtral_8x7b_counts_match_the_published_sizes():
    # 46.7B total, 12.9B per token (2 of 8 experts of 3 * 14336 * 4096 = 176,160,768 in each of 32 layers).
    assert model_params(MIXTRAL) == 46_702_792_704
    assert active_params(MIXTRAL) == 46_702_792_704 - 32 * 6 * 176_160_768 == 12_879_925_248


def test_dense_models_are_all_active():
    arch = tiny_arch("llama")
    assert active_params(arch) == model_params(arch)


def test_qwen3_30b_a3b_rank_at_tp4_ep8_etp1():
    layout = ParallelLayout(16, tp=4, sp=True, ep=8, etp=1)
    split = stage_split(QWEN3_MOE, layout, 0)
    # Dense, per TP4 rank and layer: attention / 4 + replicated norms, q/k norms and router = 4,985,088; the
    # 151,936-row vocabulary padded to 152,064 = 4 x 38,016 rows, embedding and output layer each 38,016 x 2048.
    assert split.dense == 48 * (QWEN_ATTENTION // 4 + 4096 + 256 + 262_144) + 2 * 38_016 * 2048 + 2048
    assert split.dense == 394_999_808
    # Experts: 128 / EP8 = 16 whole experts (ETP1) in each of the 48 layers.
    assert split.expert == 48 * 16 * QWEN_EXPERT == 3_623_878_656
    # ETP4 x EP2 spreads the same 1/8 of each layer's experts over a rank: 64 experts, each a quarter.
    etp4 = stage_split(QWEN3_MOE, ParallelLayout(16, tp=4, sp=True, ep=2, etp=4), 0)
    assert etp4 == split
    # PP2: 24 layers a stage; the first holds the embedding, the last the final norm and output layer.
    pp2 = ParallelLayout(16, tp=4, pp=2, sp=True, ep=8, etp=1)
    first, last = stage_split(QWEN3_MOE, pp2, 0), stage_split(QWEN3_MOE, pp2, 1)
    assert first.expert == last.expert == split.expert // 2
    assert last.dense - first.dense == 2048


def test_tiny_qwen3_moe_dense_layer_keeps_its_mlp():
    # hidden 64, 4 heads of 24 on 2 KV heads; layer 1 is dense (mlp_only_layers), layers 0, 2, 3 have 4 experts
    # of 32. TP2 x EP2, ETP1: attention (96 + 96) * 64 + 64 * 96 = 18,432 / 2 + norms 128 + q/k norms 48 = 9,392.
    layout = ParallelLayout(2, tp=2, sp=True, ep=2, etp=1)
    split = stage_split(tiny_arch("qwen3_moe"), layout, 0)
    moe_layer = 9_392 + 4 * 64  # + the router
    dense_layer = 9_392 + 3 * 96 * 64 // 2  # + the MLP split over TP
    vocab = 2 * 128 * 64 + 64  # 250 padded to 256 rows: 128 per rank, embedding and output; final norm
    assert split.dense == 3 * moe_layer + dense_layer + vocab == 64_000
    assert split.expert == 3 * 2 * 3 * 32 * 64  # 2 of 4 whole experts in 3 layers


def _qwen(**changes) -> PlanInput:
    fields = dict(
        arch=QWEN3_MOE,
        gpu="H100-80",
        world_size=16,
        tp=4,
        sp=True,
        ep=8,
        etp=1,
        seq_length=2560,
        micro_batch_size=2,
        global_batch_size=256,
        rollout_tp=4,
        reference=True,
    )
    fields.update(changes)
    return PlanInput(**fields)


def test_qwen3_30b_a3b_moe_memory_terms():
    result = plan_memory(_qwen())
    dense, expert = 394_999_808, 3_623_878_656
    train = result.train.terms
    # State: dense over DP4 (16 / TP4), experts over edp = 16 / (ETP1 x EP8) = 2.
    assert result.plan.dp == 4 and result.plan.expert_dp == 2
    assert (train["weights"], train["gradients"], train["optimizer"]) == (2 * dense, 4 * dense, 3 * dense)
    assert (train["expert weights"], train["expert gradients"]) == (2 * expert, 4 * expert)
    assert train["expert optimizer"] == 12 * expert // 2
    assert train["reference weights"] == 2 * (dense + expert)
    # Tokens at the router: T = 2560 x 2 / TP4 (SP) = 1280; rows at this rank's experts R = T x top-8 x ETP1.
    # Expert activations per layer: R (2048 + 3 x 768) x 2 B + 4 B of routing weight per row; 48 layers.
    assert train["expert activations"] == 48 * 10_240 * (4352 * 2 + 4)
    # Router: T x 128 experts x (4 + 4 + 1) B per layer.
    assert train["router logits"] == 48 * 1280 * 128 * 9
    # Dispatcher (one layer at a time): the all-to-all's send and receive buffers, 2 x T x 8 x 2048 x 2 B.
    assert train["dispatcher buffers"] == 2 * 1280 * 8 * 2048 * 2
    # The dense side: 4 s b h / TP (SP) + s b (2q + 2kv) / TP, no dense MLP, 2 B; + token ids.
    assert train["activations"] == 48 * 2 * (4 * 5120 * 2048 // 4 + 5120 * (8192 + 1024) // 4) + 16 * 5120

    # vLLM TP4 without EP holds all 128 experts per layer, each a quarter: 128 x 3 x 192 x 2048, + the router,
    # + its attention (40 / 4 heads of 128 rows, o_proj 2048 x 1024) and norms; embedding and lm_head 38,016 rows.
    per_layer = 1280 * 2048 + 2048 * 1024 + 4096 + 256 + 262_144 + 128 * 3 * 192 * 2048
    assert result.rollout.terms["rollout weights"] == 2 * (48 * per_layer + 2 * 38_016 * 2048 + 2048)
    # Rollout activations: per token 2h + top-8 (3 x 192 + 2048) fused-MoE cache, 2 B, + 4 B x 128 router logits.
    per_token = (2 * 2048 + 8 * (576 + 2048)) * 2 + 4 * 128
    assert result.rollout.terms["rollout activations"] == 8192 * per_token + 4 * 256 * 152_064
    assert result.kv_bytes_per_token == 2 * 48 * (4 // 4) * 128 * 2
    assert result.fits


def test_expert_tp_changes_the_rows_and_the_combine_buffers():
    # TP4 x EP2, ETP4: a rank's experts see the rows of its 4 expert-TP peers, each row a quarter as wide.
    plan = _qwen(ep=2, etp=None)
    train = plan_memory(plan).train.terms
    rows = 1280 * 8 * 4
    assert train["expert activations"] == 48 * rows * ((2048 + 3 * 768 // 4) * 2 + 4)
    # The combine: R output rows, their fp32 copy for the reduce-scatter, and its fp32 result (T x 8 rows).
    assert train["dispatcher buffers"] == 1280 * 8 * 2048 * (4 * (2 + 4) + 4)


def test_full_recompute_keeps_moe_layer_inputs_and_one_layer():
    selective = plan_memory(_qwen()).train.terms
    full = plan_memory(_qwen(recompute="full")).train.terms
    # Each layer keeps its input (2 B x 5120 x 2048 / 4); the recomputed layer holds its whole set again.
    one_layer = selective["activations"] - 16 * 5120
    assert full["activations"] == 48 * 2 * 5120 * 2048 // 4 + 16 * 5120 + one_layer // 48
    assert full["expert activations"] == selective["expert activations"] // 48
    assert full["router logits"] == selective["router logits"] // 48


def test_report_names_the_moe_terms_and_the_expert_layout():
    text = format_plan(plan_memory(_qwen()))
    assert "(3,353,032,704 active per token: 8 of 128 experts in 48 MoE layers)" in text
    assert "this rank holds 4,018,878,464, 3,623,878,656 of them in its 16 experts per MoE layer" in text
    assert "tp=4 pp=1 dp=4 ep=8 etp=1 edp=2 sp=True" in text
    for term in ("expert optimizer", "expert activations", "dispatcher buffers", "router logits"):
        assert term in text


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_rollout_weights_equal_the_rollout_layout(family, rollout_tp):
    # The planner's count without per-expert names equals the rollout layout's tensors (vLLM's, per expert).
    arch = tiny_arch(family)
    shapes = rollout_param_shapes(arch, rollout_tp)
    assert rollout_weight_numel(arch, rollout_tp) == sum(math.prod(shape) for shape in shapes.values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ep": 3, "world_size": 12}, r"num_experts=128 is not divisible by expert_model_parallel_size=3"),
        (
            {"ep": 8, "etp": 4},
            r"expert_tensor_parallel_size\*expert_model_parallel_size=4\*8 must divide the 16",
        ),
        ({"ep": 1, "etp": 1}, r"expert_tensor_parallel_size=1 differs from tensor_model_parallel_size=4"),
        ({"sp": False}, r"needs sequence_parallel=true"),
        (
            {
                "ep": 2,
                "etp": 4,
                "arch": ModelArch.from_hf_config({**QWEN3_30B_A3B, "moe_intermediate_size": 770}),
            },
            r"moe_intermediate_size=770 is not divisible by expert_tensor_parallel_size=4",
        ),
    ],
)
def test_expert_layouts_that_do_not_divide_name_the_field(changes, message):
    with pytest.raises(PlanError, match=message):
        plan_memory(_qwen(**changes))


def test_rollout_tp_must_divide_the_expert_width():
    arch = tiny_arch("qwen3_moe", moe_intermediate_size=33)
    plan = PlanInput(arch=arch, gpu="A100-80", world_size=2, seq_length=16, ep=2, rollout_tp=2)
    with pytest.raises(PlanError, match=r"moe_intermediate_size=33 is not divisible by the rollout"):
        plan_memory(plan)


def test_expert_parallelism_on_a_dense_model_is_refused():
    plan = PlanInput(arch=tiny_arch("llama"), gpu="A100-80", world_size=2, seq_length=16, ep=2)
    with pytest.raises(PlanError, match=r"expert_model_parallel_size .* the model has no experts"):
        plan_memory(plan)


def test_search_splits_experts_within_a_node_first():
    plan = _qwen()
    # 16 ranks of a stage at TP4: EP inside a node (EP x ETP <= 8) largest first, ETP1 before ETP4; then across
    # nodes, smallest first. EP1 only with ETP = TP (megatron reduces ETP != TP experts wrongly without EP).
    assert _expert_splits(plan, 16, 4, 1) == [
        (8, 1),
        (4, 1),
        (2, 1),
        (2, None),
        (1, None),
        (4, None),
        (16, 1),
    ]
    # Mixtral's 8 experts over 32 ranks at TP1: EP divides the experts (no 16 or 32).
    assert [ep for ep, _ in _expert_splits(plan.with_layout(arch=MIXTRAL), 32, 1, 1)] == [8, 4, 2, 1]
    # A dense model has one split: none.
    assert _expert_splits(plan.with_layout(arch=tiny_arch("llama")), 16, 4, 1) == [(1, None)]


def test_search_proposes_a_fitting_expert_parallel_layout():
    asked = _qwen(world_size=8, tp=1, sp=False, ep=1, etp=None, micro_batch_size=1, rollout_tp=1)
    assert not plan_memory(asked).fits
    proposal = smallest_fitting_layout(asked)
    assert proposal is not None and proposal.fits
    p = proposal.plan
    # On one node: TP2 (SP) x EP8, ETP1, the experts' EP group the whole node, with full recompute (0.4 GiB to
    # spare; slime's TP4 x EP8 leaves more, the search takes the smallest model-parallel split that fits).
    assert (p.world_size, p.tp, p.pp, p.ep, p.layout.expert_tp, p.sp) == (8, 2, 1, 8, 1, True)
    assert p.recompute == "full"
    # The smaller split TP1 does not fit on 8 GPUs even with its best expert split and full recompute.
    for rollout_tp in (1, 2, 4):
        tp1 = asked.with_layout(ep=8, etp=1, recompute="full", rollout_tp=rollout_tp)
        assert not plan_memory(tp1).fits


def test_check_rank_compares_the_expert_optimizer_over_the_expert_dp_group():
    plan = PlanInput(arch=tiny_arch("qwen3_moe"), gpu="A100-80", world_size=2, tp=2, sp=True, ep=2, etp=1)
    dense, expert = 64_000, 36_864
    good = RankBytes(
        stage=0,
        params=dense + expert,
        param_tensors=40,
        weights_bytes=2 * (dense + expert),
        grads_bytes=4 * (dense + expert),
        grad_buckets=2,
        optimizer_bytes=6 * dense + 12 * expert,
        expert_params=expert,
        expert_optimizer_bytes=12 * expert,
    )
    assert check_rank(plan, good, 12 * dense, 12 * expert) == []
    assert check_rank(plan, good, 12 * dense, 6 * expert) == [
        f"expert optimizer bytes over the expert-DP group {6 * expert:,} != planned {12 * expert:,}"
    ]
    unmarked = RankBytes(**{**good.__dict__, "expert_params": 0})  # experts megatron would reduce over DP
    assert check_rank(plan, unmarked, 12 * dense, 12 * expert) == [
        f"expert-parallel parameters 0 != planned {expert:,}"
    ]
