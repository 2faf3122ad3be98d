"""LoRA adapters on megatron-core's tensor-parallel linears: frozen base, low-rank update, sharded like the base.

A targeted linear keeps its megatron class, parameters and names; its class is swapped for a subclass whose
forward adds ``scale * B(A(dropout(x)))`` (``scale = alpha / rank``, peft's LoRA) and whose checkpoint entries
shard the adapters like the base. One adapter per Hugging Face projection, as peft has them, so a PEFT adapter
maps tensor for tensor:

    HF (peft)                       megatron module          adapter names in the full state
    q_proj, k_proj, v_proj          self_attention.linear_qkv ...linear_qkv.lora_A.q_proj.weight [r, h],
                                                               ...linear_qkv.lora_B.q_proj.weight [heads*d, r]
    o_proj                          self_attention.linear_proj ...linear_proj.lora_A.o_proj.weight, lora_B...
    gate_proj, up_proj              mlp.linear_fc1           ...linear_fc1.lora_A.gate_proj.weight, ...
    down_proj                       mlp.linear_fc2           ...linear_fc2.lora_A.down_proj.weight, ...

Tensor parallelism (why each adapter is split as it is):

- A column-parallel base (``linear_qkv``, ``linear_fc1``) splits its output rows. A is replicated, each B is
  split by output rows: a rank's ``linear_qkv`` rows are its query groups, each ``[q heads; k; v]``, so B_q,
  B_k and B_v are split by query group and their products interleaved per group; ``linear_fc1`` holds
  ``[gate_r; up_r]``, so B_gate and B_up are split separately. The merged shard ``W_r + scale * dW_r`` then
  equals the TP shard of the merged full weight (tested). The rank-r activations ``z = A x`` are computed once
  per rank; megatron's copy (no SP) or sequence all-gather (SP: ``z`` is computed on the local sequence chunk,
  then gathered: [s, b, r], not [s, b, h]) makes A's gradient whole on every rank.
- A row-parallel base (``linear_proj``, ``linear_fc2``) splits its input columns: A is split by input columns,
  B is replicated. The partial ``z_r = A_r x_r`` are summed over TP (an all-reduce, or a reduce-scatter over
  the sequence with SP) before B; summing [s, b, r] rather than adding ``B z_r`` into the base's partial
  output keeps B's gradient whole without a reduction of its own.
- Under sequence parallelism the replicated adapter (column A, row B) sees only its rank's tokens, so its
  gradient is marked ``sequence_parallel`` and megatron's grad finalisation sums it over TP, as for the norms.

The base is frozen before DDP is built: no gradient, no optimizer state, no DDP bucket. A LoRA layer computes
its base product itself (the same GEMM, the same collectives) so that no weight gradient of the base is formed
(megatron's linear autograd function computes one whatever ``requires_grad`` says). With the adapters switched
off (:func:`adapters_disabled`) the layer is megatron's own: that is the reference policy without a copy.

Transformer Engine's linears are not wrapped: a model with LoRA uses megatron's local layer spec on any device
(``engine/model.py``), and asking for TE with LoRA is refused.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.lora_spec import ROW_PARALLEL, SEGMENTS, LoRASpec, moe_targets_problem
from mcore_rl.engine.weights import chunk_layer_offsets, is_adapter_param, local_parameters, unwrap
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.reshard.naming import canonical_key


# --- the layers ---------------------------------------------------------------------------------------------
class _Weight(torch.nn.Module):
    """One adapter matrix, named ``<module>.lora_A.<projection>.weight`` as peft names its tensors."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


class _LoRAMixin:
    """What a LoRA layer adds to its megatron linear (see the module docstring)."""

    lora_A: torch.nn.ModuleDict  # noqa: N815 (peft's tensor names)
    lora_B: torch.nn.ModuleDict  # noqa: N815
    lora_spec: LoRASpec
    lora_blocks: int
    """Output rows of a column-parallel base come in this many blocks (the local query groups of
    ``linear_qkv``; 1 for ``linear_fc1``), each the projections' widths one after the other."""
    lora_widths: tuple[int, ...]
    """Each projection's rows per block, in :data:`SEGMENTS` order."""
    lora_enabled: bool = True

    def lora_a(self, projection: str) -> torch.Tensor:
        module: Any = self.lora_A[projection]
        return module.weight

    def lora_b(self, projection: str) -> torch.Tensor:
        module: Any = self.lora_B[projection]
        return module.weight

    def lora_projections(self) -> tuple[str, ...]:
        return SEGMENTS[self.lora_module_path]  # type: ignore[attr-defined]

    def lora_delta_weight(self) -> torch.Tensor:
        """``scale * dW`` of this rank's shard, in fp32: the merged shard is ``weight + lora_delta_weight()``."""
        scale = self.lora_spec.scale
        if isinstance(self, _LoRARow):
            (name,) = self.lora_A.keys()
            a, b = self.lora_a(name).float(), self.lora_b(name).float()
            return scale * (b @ a)
        parts = [
            self.lora_b(n).float() @ self.lora_a(n).float() if n in self.lora_A else None
            for n in self.lora_projections()
        ]
        return scale * interleave(parts, self.lora_blocks, self.lora_widths, self.weight.shape[1])  # type: ignore[attr-defined]

    def _lora_input(self, x: torch.Tensor, same_on_tp_ranks: bool) -> torch.Tensor:
        p = self.lora_spec.dropout
        if p == 0 or not self.training:  # type: ignore[attr-defined]
            return x
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            get_data_parallel_rng_tracker_name,
        )

        # The same mask on every TP rank where they hold the same tokens (column, no SP); their own otherwise.
        stream = get_data_parallel_rng_tracker_name() if same_on_tp_ranks else "model-parallel-rng"
        with get_cuda_rng_tracker().fork(stream):
            return F.dropout(x, p)


class _LoRAColumn(_LoRAMixin):
    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.lora_enabled or weight is not None:
            return super().forward(input_, weight, runtime_gather_output)  # type: ignore[misc]
        from megatron.core.tensor_parallel import mappings

        layer: Any = self
        group, sp = layer.tp_group, layer.sequence_parallel
        x = self._lora_input(input_, same_on_tp_ranks=not sp)
        z = {n: F.linear(x, self.lora_a(n)) for n in self.lora_A}  # [s(/tp), b, r]
        if sp:
            total = mappings.gather_from_sequence_parallel_region(input_, True, group)
            z = {n: mappings.gather_from_sequence_parallel_region(v, True, group) for n, v in z.items()}
        else:
            total = mappings.copy_to_tensor_model_parallel_region(input_, group)
            z = {n: mappings.copy_to_tensor_model_parallel_region(v, group) for n, v in z.items()}
        bias = None if layer.skip_bias_add else layer.bias
        output = F.linear(total, layer.weight, bias)
        deltas = [F.linear(z[n], self.lora_b(n)) if n in z else None for n in self.lora_projections()]
        output = output + self.lora_spec.scale * interleave_last(deltas, self.lora_blocks, self.lora_widths)
        gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = mappings.gather_from_tensor_model_parallel_region(output, group)
        return output, layer.bias if layer.skip_bias_add else None


class _LoRARow(_LoRAMixin):
    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.lora_enabled:
            return super().forward(input_)  # type: ignore[misc]
        from megatron.core.tensor_parallel import mappings

        layer: Any = self
        group = layer.tp_group
        (name,) = self.lora_A.keys()
        partial = F.linear(input_, layer.weight)
        z = F.linear(self._lora_input(input_, same_on_tp_ranks=False), self.lora_a(name))
        if layer.sequence_parallel:
            output = mappings.reduce_scatter_to_sequence_parallel_region(partial, group)
            z = mappings.reduce_scatter_to_sequence_parallel_region(z, group)
        else:
            output = mappings.reduce_from_tensor_model_parallel_region(partial, group)
            z = mappings.reduce_from_tensor_model_parallel_region(z, group)
        output = output + self.lora_spec.scale * F.linear(z, self.lora_b(name))
        if layer.skip_bias_add:
            return output, layer.bias
        return (output + layer.bias if layer.bias is not None else output), None


def interleave(
    parts: list[torch.Tensor | None], blocks: int, widths: Sequence[int], cols: int
) -> torch.Tensor:
    """Stack per-projection [blocks * width, cols] weights as a column-parallel shard's rows: block by block,
    each block the projections one after the other (None: zeros)."""
    ref = next(p for p in parts if p is not None)
    pieces = [
        (p if p is not None else ref.new_zeros(blocks * w, cols)).view(blocks, w, cols)
        for p, w in zip(parts, widths, strict=True)
    ]
    return torch.cat(pieces, dim=1).reshape(blocks * sum(widths), cols)


def interleave_last(parts: list[torch.Tensor | None], blocks: int, widths: Sequence[int]) -> torch.Tensor:
    """:func:`interleave` on the last dimension of activations [..., blocks * width]."""
    ref = next(p for p in parts if p is not None)
    lead = ref.shape[:-1]
    if len(parts) == 1:
        return ref
    pieces = [
        (p if p is not None else ref.new_zeros(*lead, blocks * w)).reshape(*lead, blocks, w)
        for p, w in zip(parts, widths, strict=True)
    ]
    return torch.cat(pieces, dim=-1).reshape(*lead, blocks * sum(widths))


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    """The LoRA subclass of megatron linear class ``base`` (made once per class)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if base not in _CLASSES:
        if base is ColumnParallelLinear:
            mixin: type = _LoRAColumn
        elif base is RowParallelLinear:
            mixin = _LoRARow
        else:
            raise ValueError(
                f"LoRA (model.lora_rank > 0) wraps megatron's local-spec linears, not {base.__name__} "
                "(Transformer Engine's linears are not supported: build the model without TE)"
            )
        _CLASSES[base] = type(
            f"LoRA{base.__name__}", (mixin, base), {"sharded_state_dict": _sharded_state_dict}
        )
    return _CLASSES[base]


def _sharded_state_dict(
    self: Any, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
) -> Any:
    """The base's checkpoint entries plus the adapters, each split as it is held (column: B by rows; row: A
    by columns; the other replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    row = isinstance(self, _LoRARow)
    axes = {"weight": 1} if row else {"weight": 0, "bias": 0}
    for name in self.lora_A:
        axes[f"lora_A.{name}.weight" if row else f"lora_B.{name}.weight"] = 1 if row else 0
    state = self.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(
        state, prefix, axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
    )


# --- building -----------------------------------------------------------------------------------------------
def add_adapters(chunks: list[Any], spec: LoRASpec, arch: ModelArch, ctx: ParallelContext) -> int:
    """Freeze the (bare, not yet DDP-wrapped) ``chunks`` and give their targeted linears adapters: A drawn as
    peft draws it (Kaiming-uniform, a=sqrt(5)) from a generator of its own per tensor, so the full A is the
    same at every layout; B zero, so the adapted model starts as its base. Returns the adapted modules."""
    problem = moe_targets_problem(spec.targets) if arch.moe is not None else None
    if problem is not None:
        raise ValueError(problem)
    count = 0
    for chunk, offset in zip(chunks, chunk_layer_offsets(arch, ctx), strict=True):
        model = unwrap(chunk)
        model.requires_grad_(False)
        for i, layer in enumerate(model.decoder.layers):
            for path in spec.modules():
                prefix = f"decoder.layers.{offset + i}.{path}"
                _install(layer.get_submodule(path), path, spec, arch, ctx, prefix)
                count += 1
    return count


def _install(
    module: Any, path: str, spec: LoRASpec, arch: ModelArch, ctx: ParallelContext, prefix: str
) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    module.__class__ = _lora_class(type(module))
    tp, row = ctx.tp_size, path in ROW_PARALLEL
    weight = module.weight
    blocks, widths = _row_layout(path, arch, tp, weight.shape[0])
    module.lora_module_path, module.lora_spec = path, spec
    module.lora_blocks, module.lora_widths = blocks, widths
    module.lora_A, module.lora_B = torch.nn.ModuleDict(), torch.nn.ModuleDict()
    sp = bool(getattr(module, "sequence_parallel", False))
    for name, width in zip(SEGMENTS[path], widths, strict=True):
        if name not in spec.targets:
            continue
        fan_in = weight.shape[1] * (tp if row else 1)
        a = _initial_a(ctx.seed, f"{prefix}.lora_A.{name}.weight", spec.rank, fan_in)
        a = a.chunk(tp, dim=1)[ctx.tp_rank] if row else a
        b = torch.zeros(weight.shape[0] if row else blocks * width, spec.rank)
        module.lora_A[name] = _Weight(a.to(weight.dtype).to(weight.device).contiguous())
        module.lora_B[name] = _Weight(b.to(weight.dtype).to(weight.device))
        split, whole = (
            (module.lora_A[name], module.lora_B[name]) if row else (module.lora_B[name], module.lora_A[name])
        )
        set_tensor_model_parallel_attributes(split.weight, True, 1 if row else 0, 1)
        if sp:  # sees only this rank's tokens: megatron's finalisation sums its gradient over TP
            whole.weight.sequence_parallel = True


def _row_layout(path: str, arch: ModelArch, tp: int, rows: int) -> tuple[int, tuple[int, ...]]:
    """(blocks, widths) of a module's local output rows (see :class:`_LoRAMixin`)."""
    if path == "self_attention.linear_qkv":
        per_group = arch.num_attention_heads // arch.num_query_groups
        d = arch.head_dim
        return arch.num_query_groups // tp, (per_group * d, d, d)
    if path == "mlp.linear_fc1":
        return 1, (rows // 2, rows // 2)
    return 1, (rows,)


def _initial_a(seed: int, key: str, rank: int, fan_in: int) -> torch.Tensor:
    """peft's A init, ``kaiming_uniform_(a=sqrt(5))`` on [rank, fan_in]: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).float()


# --- using them ---------------------------------------------------------------------------------------------
def lora_modules(chunks: list[Any]) -> Iterator[Any]:
    """Every LoRA layer of the chunks (DDP / Float16Module wrappers looked through)."""
    for chunk in chunks:
        for module in unwrap(chunk).modules():
            if isinstance(module, _LoRAMixin):
                yield module


def has_adapters(chunks: list[Any]) -> bool:
    return next(lora_modules(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list[Any]) -> Iterator[None]:
    """Within the block every LoRA layer is its frozen base (the reference policy of a LoRA run)."""
    modules = list(lora_modules(chunks))
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True


@torch.no_grad()
def rollout_parameters(
    chunks: list[Any], arch: ModelArch, ctx: ParallelContext
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`~mcore_rl.engine.weights.local_parameters` with every adapted weight merged, shard by shard on
    its own rank (``W_r + scale * dW_r``, in fp32, cast back): what the rollout engines receive. Adapters
    themselves are not yielded; the names are the base's, so the reshard plan and converters are unchanged."""
    owners = {id(m.weight): m for m in lora_modules(chunks)}
    for key, param in local_parameters(chunks, arch, ctx):
        module = owners.get(id(param))
        if module is None:
            yield key, param
        else:
            yield key, (param.float() + module.lora_delta_weight()).to(param.dtype)


def adapter_parameters(
    chunks: list[Any], arch: ModelArch, ctx: ParallelContext
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(full-state key, local tensor)`` of every adapter matrix of this rank (global layer numbers)."""
    for chunk, offset in zip(chunks, chunk_layer_offsets(arch, ctx), strict=True):
        for name, param in unwrap(chunk).named_parameters():
            if is_adapter_param(name):
                yield canonical_key(name, offset, tied=False), param


def adapter_split_dim(key: str) -> int | None:
    """The dimension TP splits adapter ``key`` along (column B: 0, row A: 1), None when replicated."""
    row = any(f".{p}.lora_" in key for p in ROW_PARALLEL)
    if ".lora_A." in key:
        return 1 if row else None
    return None if row else 0


@torch.no_grad()
def load_adapter_state(
    chunks: list[Any], full: dict[str, torch.Tensor], arch: ModelArch, ctx: ParallelContext, where: str
) -> None:
    """Copy this rank's slices of a full adapter state (:func:`gather_adapter_state`'s form) into ``chunks``.
    Every adapter of the model must be there, with its full shape, and nothing else (``where`` names the
    source in the error)."""
    mine = dict(adapter_parameters(chunks, arch, ctx))
    for key, param in mine.items():
        if key not in full:
            raise ValueError(
                f"{where}: no tensor for adapter {key} (the run's model.target_modules adapt it)"
            )
        dim = adapter_split_dim(key)
        tensor = full[key] if dim is None else full[key].chunk(ctx.tp_size, dim=dim)[ctx.tp_rank]
        if tensor.shape != param.shape:
            raise ValueError(
                f"{where}: {key} has shape {list(full[key].shape)}, the model's adapter is another"
            )
        param.copy_(tensor)


@torch.no_grad()
def gather_adapter_state(
    chunks: list[Any], arch: ModelArch, ctx: ParallelContext, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every adapter of the model as full (TP=1) CPU tensors, on every rank (gathered over TP and PP; adapters
    are small). ``grads``: their gradients instead (DDP's ``main_grad``, after the step's reduction)."""
    import torch.distributed as dist

    local: dict[str, torch.Tensor] = {}
    for key, tensor in adapter_parameters(chunks, arch, ctx):
        param = getattr(tensor, "main_grad") if grads else tensor  # noqa: B009 (DDP sets it)
        dim = adapter_split_dim(key)
        if dim is not None and ctx.tp_size > 1:
            parts = [torch.empty_like(param) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, param.detach().contiguous(), group=ctx.tp_group)
            local[key] = torch.cat(parts, dim=dim).cpu()
        else:
            local[key] = param.detach().cpu().clone()
    stages: list[dict[str, torch.Tensor] | None] = [None] * ctx.pp_size
    dist.all_gather_object(stages, local, group=ctx.pp_group)
    return {k: v for stage in stages for k, v in (stage or {}).items()}


def merge_full_state(
    full: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], spec: LoRASpec, arch: ModelArch
) -> dict[str, torch.Tensor]:
    """A full (TP=1) base state with the full adapters merged in: a plain model. Pure."""
    return {key: merged_weight(key, weight, adapters, spec, arch) for key, weight in full.items()}


def merged_weight(
    key: str,
    weight: torch.Tensor,
    adapters: dict[str, torch.Tensor],
    spec: LoRASpec,
    arch: ModelArch,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Full-state tensor ``key`` with its adapters merged (``W + scale * B A`` in fp32, cast once to ``dtype``,
    None: the weight's own; the fused QKV's and [gate; up]'s rows as :func:`interleave` lays them); itself when
    nothing adapts it. Pure."""
    path = next((p for p in spec.modules() if key.endswith(f".{p}.weight")), None)
    if path is None or not key.startswith("decoder.layers."):
        return weight
    prefix = key.removesuffix(".weight")
    parts = [
        adapters[f"{prefix}.lora_B.{n}.weight"].float() @ adapters[f"{prefix}.lora_A.{n}.weight"].float()
        if n in spec.targets
        else None
        for n in SEGMENTS[path]
    ]
    blocks, widths = _row_layout(path, arch, 1, weight.shape[0])
    delta = interleave(parts, blocks, widths, weight.shape[1])
    return (weight.float() + spec.scale * delta).to(dtype or weight.dtype)


# --- checkpoints --------------------------------------------------------------------------------------------
def adapters_only(state: dict[str, Any]) -> dict[str, Any]:
    """The adapter entries of one chunk's sharded state dict (a LoRA run checkpoint's model part)."""
    return {k: v for k, v in state.items() if is_adapter_param(k)}


def without_adapters(state: dict[str, Any]) -> dict[str, Any]:
    """One chunk's sharded state dict without its adapters (the base, as a model checkpoint holds it)."""
    return {k: v for k, v in state.items() if not is_adapter_param(k)}


@torch.no_grad()
def merged(state: dict[str, Any], chunks: list[Any]) -> dict[str, Any]:
    """One chunk's sharded state dict as a plain model's: every adapted weight merged (this rank's shard, as
    the rollout gets it), no adapter entry. What ``TrainEngine.save_model`` writes with LoRA."""
    import dataclasses

    owners = {id(m.weight): m for m in lora_modules(chunks)}
    out = {}
    for key, entry in without_adapters(state).items():
        module = owners.get(id(getattr(entry, "data", None)))
        if module is not None:
            weight = module.weight
            entry = dataclasses.replace(
                entry, data=(weight.float() + module.lora_delta_weight()).to(weight.dtype)
            )
        out[key] = entry
    return out
