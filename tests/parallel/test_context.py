"""ParallelContext on a real gloo world: megatron's groups equal the pure layout's, errors are clear."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.layout import LayoutError


def _groups_match_layout(
    tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None, cp: int = 1
) -> dict:
    with ParallelContext.initialize(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            sequence_parallel=tp > 1 and ep > 1,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            context_parallel_size=cp,
        )
    ) as ctx:
        layout = ctx.layout
        rank = dist.get_rank()
        return {
            "tp": (dist.get_process_group_ranks(ctx.tp_group), layout.group_of(layout.tp_groups(), rank)),
            "pp": (dist.get_process_group_ranks(ctx.pp_group), layout.group_of(layout.pp_groups(), rank)),
            "dp": (dist.get_process_group_ranks(ctx.dp_group), layout.group_of(layout.dp_groups(), rank)),
            "mp": (
                dist.get_process_group_ranks(ctx.model_parallel_group),
                layout.group_of(layout.model_parallel_groups(), rank),
            ),
            "cp": (dist.get_process_group_ranks(ctx.cp_group), layout.group_of(layout.cp_groups(), rank)),
            "dp_cp": (
                dist.get_process_group_ranks(ctx.dp_cp_group),
                layout.group_of(layout.dp_cp_groups(), rank),
            ),
            "coords": (
                (
                    ctx._ps.get_tensor_model_parallel_rank(),
                    ctx._ps.get_pipeline_model_parallel_rank(),
                    ctx._ps.get_data_parallel_rank(),
                    ctx._ps.get_context_parallel_rank(),
                ),
                (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank),
            ),
            "ep": (dist.get_process_group_ranks(ctx.ep_group), layout.group_of(layout.ep_groups(), rank)),
            "etp": (
                dist.get_process_group_ranks(ctx.expert_tp_group),
                layout.group_of(layout.expert_tp_groups(), rank),
            ),
            "edp": (
                dist.get_process_group_ranks(ctx.expert_dp_group),
                layout.group_of(layout.expert_dp_groups(), rank),
            ),
            "expert_coords": (
                (ctx._ps.get_expert_model_parallel_rank(), ctx._ps.get_expert_tensor_parallel_rank()),
                (ctx.ep_rank, ctx.expert_tp_rank),
            ),
        }


@pytest.mark.parametrize(
    ("world_size", "tp", "pp"), [(2, 2, 1), (2, 1, 2), (2, 1, 1), (4, 2, 2), (4, 1, 2), (4, 2, 1)]
)
def test_megatron_groups_equal_layout_groups(run_distributed, world_size, tp, pp):
    for per_rank in run_distributed(_groups_match_layout, tp, pp, world_size=world_size):
        for name, (megatron_view, ours) in per_rank.items():
            assert list(megatron_view) == list(ours), name


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "etp"),
    [(1, 1, 2, None), (1, 1, 4, None), (2, 1, 2, None), (2, 1, 2, 1), (1, 2, 2, None), (2, 1, 1, 1)],
    ids=["ep2", "ep4", "tp2-ep2", "tp2-ep2-etp1", "pp2-ep2", "tp2-etp1"],
)
def test_megatron_expert_groups_equal_layout_groups(run_distributed, tp, pp, ep, etp):
    # world 4: expert parallelism folded into data parallelism, megatron's expert RankGenerator
    for per_rank in run_distributed(_groups_match_layout, tp, pp, None, ep, etp, world_size=4):
        for name, (megatron_view, ours) in per_rank.items():
            assert list(megatron_view) == list(ours), name


@pytest.mark.parametrize(
    ("tp", "pp", "cp"), [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)], ids=["cp2", "cp4", "tp2-cp2", "pp2-cp2"]
)
def test_megatron_context_parallel_groups_equal_layout_groups(run_distributed, tp, pp, cp):
    # world 4: megatron's tp-cp-ep-dp-pp order, CP ranks next to TP, gradients reduced over DP x CP
    for per_rank in run_distributed(_groups_match_layout, tp, pp, None, 1, None, cp, world_size=4):
        for name, (megatron_view, ours) in per_rank.items():
            assert list(megatron_view) == list(ours), name


def _second_context_refused() -> str:
    with ParallelContext.initialize(ParallelConfig()):
        try:
            ParallelContext.initialize(ParallelConfig())
        except RuntimeError as err:
            return str(err)
    return "no error"


def test_only_one_active_context(run_distributed):
    assert all("already active" in m for m in run_distributed(_second_context_refused))


def _bad_size_error() -> str:
    try:
        ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=3))
    except LayoutError as err:
        return str(err)
    return "no error"


def test_sizes_not_dividing_world_are_named(run_distributed):
    for message in run_distributed(_bad_size_error):
        assert "world_size=2" in message and "tensor_model_parallel_size" in message


def _rebuild_in_same_world() -> list[int]:
    sizes = []
    for tp in (2, 1, 2):
        with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=tp)) as ctx:
            sizes.append(dist.get_world_size(ctx.tp_group))
    return sizes


def test_contexts_rebuild_in_one_world(run_distributed):
    assert run_distributed(_rebuild_in_same_world) == [[2, 1, 2], [2, 1, 2]]


def _threads_after_rebuilds() -> tuple[int, int]:
    import psutil

    def count() -> int:
        return psutil.Process().num_threads()

    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)):
        pass
    baseline = count()
    for _ in range(5):
        with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)):
            pass
    return baseline, count()


def test_destroy_releases_megatron_groups(run_distributed):
    for baseline, after in run_distributed(_threads_after_rebuilds):
        assert after <= baseline + 2, f"threads grew from {baseline} to {after} over 5 rebuilds"


def _gloo_loops_around_a_context() -> dict:
    from mcore_rl.compat.gloo_device import gloo_loop_threads

    before = gloo_loop_threads()
    with ParallelContext.initialize(ParallelConfig()) as ctx:  # both ranks data parallel
        during = gloo_loop_threads()
        groups = len(ctx._megatron_groups)
        sums = []
        for group in (ctx.dp_group, ctx._ps.get_data_parallel_group_gloo(), ctx.tp_group):
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value, group=group)
            sums.append(value.item())
    return {"before": before, "during": during, "groups": groups, "sums": sums}


def test_megatron_groups_share_one_gloo_transport_loop(run_distributed):
    """torch gives each gloo group a device whose loop thread wakes every 10 ms; a context's two dozen groups
    share one device (``compat/gloo_device.py``), and each group still reduces over its own ranks."""
    for per_rank in run_distributed(_gloo_loops_around_a_context):
        assert per_rank["groups"] >= 10, per_rank  # megatron built its groups (and their gloo copies)
        assert per_rank["during"] <= per_rank["before"] + 1, per_rank
        assert per_rank["sums"] == [3.0, 3.0, per_rank["sums"][2]], per_rank
        assert per_rank["sums"][2] in (1.0, 2.0), per_rank  # a group of one: the rank's own value


def _small_reductions(tp: int) -> dict:
    """ctx.all_reduce over the world and the data-parallel group against gloo's own, with the shared-memory
    reducer it opened per group; non-contiguous, integer and multi-piece tensors included. Sums of more than two
    floats may differ from gloo's in the last bits (another order of addition), never between ranks."""

    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=tp)) as ctx:
        rank = dist.get_rank()
        generator = torch.Generator().manual_seed(rank)
        cases = {
            "world_sum": (torch.randn(6, generator=generator), None, "sum"),
            "world_max": (torch.randn(3, generator=generator), None, "max"),
            "dp_sum_ints": (torch.arange(5) * (rank + 1), ctx.dp_group, "sum"),
            "dp_sum_strided": (torch.randn(4, 6, generator=generator)[:, ::2], ctx.dp_group, "sum"),
            "dp_max_pieces": (torch.randn(3000, generator=generator), ctx.dp_group, "max"),  # 3 slots' worth
        }
        out = {}
        for name, (tensor, group, op) in cases.items():
            ours, theirs = tensor.clone(), tensor.clone()
            ctx.all_reduce(ours, group, op)
            dist.all_reduce(theirs, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
            out[name] = (ours, theirs)
        out["host"] = {k is None: v is not None for k, v in ctx._host_reducers.items()}
        try:
            ctx.all_reduce(torch.ones(1), op="min")
        except ValueError as err:
            out["refused"] = str(err)
    return out


@pytest.mark.parametrize(("world_size", "tp"), [(2, 1), (4, 2)])
def test_small_all_reduce_equals_gloo_through_host_memory(run_distributed, world_size, tp):
    from mcore_rl.ops._native import extension_loaded

    results = run_distributed(_small_reductions, tp, world_size=world_size)
    for result in results:
        assert result.pop("host") == {True: extension_loaded(), False: extension_loaded()}
        assert result.pop("refused") == "all_reduce: op 'min' is not 'sum' or 'max'"
        for name, (ours, theirs) in result.items():
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=name)
            if name.startswith("world"):  # bitwise the same on every rank of the group
                assert torch.equal(ours, results[0][name][0]), name
