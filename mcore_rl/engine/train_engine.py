"""A megatron-core training engine: model chunks under DDP, the (distributed) optimizer, pipeline schedules.

Actor, critic and reward-model workers are thin layers over this: they say what a micro-batch is and what
its loss is; the engine runs megatron's forward/backward schedule (no pipelining, 1F1B or interleaved,
whichever the layout needs) and the optimizer step.

Loss scaling is explicit. A loss function returns its micro-batch's share of the *global* loss (e.g. token
sum divided by the global token count, see ``mcore_rl.algo``), and the engine makes sure nothing rescales
it: megatron's per-token mode keeps the schedule from dividing by the number of micro-batches and DDP from
averaging over DP, and our ``finalize`` skips megatron's division by the token count. The gradient is then
exactly the gradient of the global loss, however the batch is split over DP ranks and micro-batches.

A loss that reads log-probs at a few positions wraps itself in :class:`HeadLoss`: the last stage then skips
megatron's output layer and the loss gets the final hidden states with this rank's vocab shard of the output
weight (:class:`LMHeadInput`), so it projects only the positions it reads and the [tokens x vocab] logits are
never materialised (the fused ``linear_logprob_entropy`` op streams vocab chunks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from mcore_rl.compat import megatron_cpu
from mcore_rl.compat.grad_reduce import reduce_grads_on_host
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import ModelCheckpointInfo, load_model, save_model
from mcore_rl.engine.context_parallel import ContextShard, context_shards
from mcore_rl.engine.forward_step import FILLER_RECORD, forward_step, model_input
from mcore_rl.engine.lm_head import HeadLoss, keep_logits_bytes
from mcore_rl.engine.lora import adapters_disabled, add_adapters, merged, without_adapters
from mcore_rl.engine.model import ModelOptions, build_model_chunks
from mcore_rl.engine.moe import (
    FillerMicroBatch,
    RouterLosses,
    RoutingTaps,
    balanced_for_experts,
    filled_for_interleaving,
    read_router_losses,
    router_loss_scope,
)
from mcore_rl.engine.optim import OptimConfig, megatron_adam, use_fused_torch_adam
from mcore_rl.engine.weights import load_full_state, unwrap
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.host_reduce import open_for_buckets


class NonFiniteLossError(RuntimeError):
    """A loss went NaN/inf on some rank; no optimizer step was taken, so no NaN reached the weights. It crosses
    the Ray boundary as itself (``WorkerError.cause``), so the driver recognises it by type."""


@dataclass
class MicroBatch:
    """One micro-batch for the model: right-padded token ids and whatever the loss needs."""

    tokens: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s] int64
    packed: PackedInput | None = None
    """The model's input with the rows packed end to end (no padding computed); None: ``tokens`` as they are.
    Losses read ``tokens`` either way; a role's micro-batch subclass adds what its loss reads (its rows of the
    batch, masks), whose tensors follow the batch to the engine's device."""
    expert_choices: torch.Tensor | None = None
    """[b, s, L, k] int16, mixture-of-experts models: the rollout's routing of these rows
    (``RolloutBatch.expert_choices``), for the routing-agreement metric and router replay (``engine/moe.py``)."""
    context: ContextShard | None = None
    """Context parallelism: this CP rank's share of the model input (set by the engine; losses read the rows
    as always, gathered from every CP rank: ``engine/context_parallel.py``)."""

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch (subclass and all) with every tensor in it on ``device``, nested records and
        packing metadata included; itself where they already are (the CPU case)."""
        if self.tokens.device == device:
            return self
        moved: MicroBatch = _on_device(self, device)
        return moved


@dataclass(frozen=True)
class PackedInput:
    """The model input of a micro-batch whose [b, s] rows are laid end to end in one sequence (megatron's
    ``thd`` layout with ``PackedSeqParams``; built by ``engine/packing/token_batching.py``): no padding column is
    computed and attention stays within each row. The engine scatters the model's packed output back to the
    [b, s] rows, so a loss reads the same tensors as on the padded path."""

    tokens: torch.Tensor
    """[1, T] int64."""
    position_ids: torch.Tensor
    """[1, T] int64, restarting at 0 in every row."""
    seq_params: Any
    """megatron's ``PackedSeqParams`` (cumulative row lengths)."""
    index: torch.Tensor
    """[n] int64: where packed token j sits in the flattened [b, s] rows (j < n; filler tokens follow)."""
    source: torch.Tensor | None = None
    """[b * s] int64: the packed token read at each row position (T: none, the row reads 0 there); set when
    a packed token feeds several rows (``engine/packing/shared_prefix.py``), else ``index`` says it all."""


def _on_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _on_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init
        }
        return dataclasses.replace(value, **fields)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value


M = TypeVar("M")
"""What a loss returns beside the loss for each micro-batch: a typed record of detached tensors (its metrics,
or the outputs of a forward-only pass); :meth:`TrainEngine.forward_backward` returns them in order."""

# loss_fn(model_output [b, s, V/tp] or [b, s, 1], micro_batch) -> (loss scalar, record)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, M]]


@dataclass(frozen=True)
class StepResult:
    update_successful: bool
    grad_norm: float
    """Global gradient norm before clipping, over all ranks and shards."""


def _finalize_without_token_scaling(
    model: list[Any], num_tokens: Any = None, *args: Any, **kwargs: Any
) -> None:
    """megatron's grad finalisation (DP reduce, SP norms, tied embeddings) minus its 1/num_tokens scaling."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, *args, **kwargs)


class TrainEngine:
    """Model chunks + optimizer for one role (actor, critic, ...). Build with :meth:`build`."""

    def __init__(
        self,
        ctx: ParallelContext,
        arch: ModelArch,
        chunks: list[Any],
        optimizer: Any,
        config: Any,
        options: ModelOptions | None = None,
    ) -> None:
        self.ctx = ctx
        self.arch = arch
        self.chunks = chunks
        self.optimizer = optimizer
        self.config = config
        self.options = options or ModelOptions()
        """How the chunks were built (dtype, value head, ...): a copy is built alike."""
        self.router_losses = RouterLosses()
        """MoE models: the router's auxiliary losses of the last training forward-backward (engine/moe.py)."""
        self.routing: RoutingTaps | None = None
        """MoE models: taps on the routers comparing (or replacing) their choices with a micro-batch's
        ``expert_choices``; :meth:`watch_routing` installs them."""
        self.adapters_off = False
        """LoRA: this engine is the reference view of another one's chunks, run with the adapters off."""
        self.keep_logits_bytes = keep_logits_bytes(self.options.keep_logits_bytes, ctx.device, ctx.world_size)
        """Logits of a micro-batch the LM head keeps from its forward for its backward (engine/lm_head.py)."""

    @classmethod
    def forward_only(cls, arch: ModelArch, ctx: ParallelContext, options: ModelOptions) -> TrainEngine:
        """Randomly initialised chunks without gradients, DDP or optimizer (a reference or reward model)."""
        chunks = build_model_chunks(arch, ctx, options)
        for chunk in chunks:
            chunk.requires_grad_(False)
        config = chunks[0].config
        config.calculate_per_token_loss = True  # the schedule must not rescale the (zero) forward-only loss
        return cls(ctx, arch, chunks, None, config, options)

    def frozen_copy(self) -> TrainEngine:
        """A forward-only engine over a copy of this engine's current weights (a reference policy). With LoRA,
        no copy: a view of these chunks that runs with the adapters off (the frozen base)."""
        if self.options.lora is not None:
            view = TrainEngine(self.ctx, self.arch, self.chunks, None, self.config, self.options)
            view.adapters_off = True
            return view
        copy = TrainEngine.forward_only(self.arch, self.ctx, self.options)
        for mine, theirs in zip(copy.models, self.models, strict=True):
            for (name, p), (other, q) in zip(mine.named_parameters(), theirs.named_parameters(), strict=True):
                if name != other:
                    raise RuntimeError(f"copied parameter {name!r} does not match the source's {other!r}")
                p.data.copy_(q.data)
        return copy

    @classmethod
    def build(
        cls,
        arch: ModelArch,
        ctx: ParallelContext,
        model_options: ModelOptions | None = None,
        optim: OptimConfig | None = None,
    ) -> TrainEngine:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        model_options = model_options or ModelOptions()
        optim = optim or OptimConfig(weight_decay=0.0)
        bare = build_model_chunks(arch, ctx, model_options)
        if model_options.lora is not None:  # the base frozen before DDP: no grad buffer, no optimizer state
            add_adapters(bare, model_options.lora, arch, ctx)
        config = bare[0].config
        config.calculate_per_token_loss = True
        bf16 = model_options.dtype == torch.bfloat16
        distributed = optim.distributed_on(ctx.device.type)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
        )
        chunks = [
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=Float16Module(config, chunk) if bf16 else chunk,
                disable_bucketing=i > 0,  # megatron's rule for interleaved chunks
            )
            for i, chunk in enumerate(bare)
        ]
        megatron_cpu.fuse_weight_grad_accumulation(chunks)  # on CPU: weight grads GEMM'd into DDP's buffer
        if megatron_cpu.is_applied():  # CPU ranks of one host sum gradients through shared memory, not TCP
            reduce_grads_on_host(chunks, partial(open_for_buckets, timeout_s=ctx.collective_timeout_s))
        config.finalize_model_grads_func = _finalize_without_token_scaling
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        optimizer = megatron_adam(
            chunks, optim, model_options.dtype, distributed, gloo_groups=ctx.device.type == "cpu"
        )
        engine = cls(ctx, arch, chunks, optimizer, config, model_options)
        for megatron_optimizer in engine.optimizers:
            use_fused_torch_adam(megatron_optimizer.optimizer)
        return engine

    def watch_routing(self) -> RoutingTaps:
        """Install :class:`RoutingTaps` on this engine's routers (a mixture-of-experts model)."""
        from mcore_rl.engine.weights import chunk_layer_offsets

        if self.routing is None:
            self.routing = RoutingTaps(
                self.models, self.arch, self.ctx, chunk_layer_offsets(self.arch, self.ctx)
            )
        return self.routing

    @property
    def optimizers(self) -> list[Any]:
        """The megatron optimizers under ``optimizer`` (a ChainedOptimizer holds one per parameter kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    @property
    def models(self) -> list[Any]:
        """The bare GPTModel chunks (for weight loading, export, resharding)."""
        return [unwrap(c) for c in self.chunks]

    def load_full_state(self, full: dict[str, torch.Tensor]) -> None:
        """Load a full (TP=1) state into this rank's shards and refresh the optimizer's main params."""
        load_full_state(self.models, full, self.arch, self.ctx)
        # bf16 keeps separate fp32 main params; without this the first step would undo the load.
        self.optimizer.reload_model_params()

    def save_model(self, directory: str, assets: tuple[str | None, str | None] = (None, None)) -> None:
        """Collective: the model weights (not the optimizer) as a distributed checkpoint, loadable at any
        layout by :meth:`load_model` or ``mcore-rl convert mcore-to-hf``; with LoRA the merged model. The
        tokenizer and generation files of ``assets`` (its tokenizer folder, its model folder) go with it."""
        info = ModelCheckpointInfo.for_arch(self.arch, self.config.params_dtype)
        lora = partial(merged, chunks=self.chunks) if self.options.lora else None  # a plain, merged model
        save_model(self.chunks, self.ctx, directory, info, lora, assets)

    def load_model(self, directory: str) -> None:
        """Collective: model weights saved at any layout (``save_model``, HF conversion) into this engine; the
        optimizer's main params follow (its moments are kept). With LoRA, the base (the adapters stay)."""
        load_model(self.chunks, self.ctx, directory, without_adapters if self.options.lora else None)
        if (
            self.optimizer is not None
        ):  # bf16 keeps separate fp32 main params: else the first step undoes the load
            self.optimizer.reload_model_params()

    def forward_backward(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn[M] | HeadLoss[M], forward_only: bool = False
    ) -> list[M]:
        """Run the schedule over ``micro_batches``; returns each micro-batch's record (last pipeline stage
        only; empty elsewhere).
        ``forward_only`` runs without autograd state."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro_batches:
            raise ValueError("micro_batches is empty")
        # Callers build batches on the CPU; the first GPU run failed in the embedding on cpu token ids.
        balanced = balanced_for_experts(micro_batches, self.arch, self.ctx)
        micro_batches = [
            mb.to(self.ctx.device) for mb in filled_for_interleaving(balanced, self.ctx, forward_only)
        ]
        packed = [mb.packed for mb in micro_batches if mb.packed is not None]
        if packed and self.ctx.layout.pp > 1:
            raise ValueError(
                "packed micro-batches (model.use_remove_padding) need pipeline_model_parallel_size=1"
            )
        shared = any(getattr(p.seq_params, "token_home", None) is not None for p in packed)
        if shared and not megatron_cpu.is_applied():  # its mask and positions live in compat/cpu_layers.py
            raise ValueError(
                "model.share_prompt_prefix: shared-prompt packing runs on the CPU (local layer spec)"
            )
        for chunk in self.chunks:
            chunk.train(not forward_only)
        seq_length = max(model_input(mb)[0].shape[1] for mb in micro_batches)
        if self.ctx.layout.sp and any(model_input(mb)[0].shape[1] % self.ctx.tp_size for mb in micro_batches):
            raise ValueError(
                f"sequence length {seq_length} must be divisible by TP={self.ctx.tp_size} with SP"
            )
        micro_batches = context_shards(micro_batches, self.ctx)  # each CP rank runs its share of the tokens
        iterators = [iter(micro_batches) for _ in self.chunks]
        # Guarded: a rank that raises mid-schedule stops its peers' pipeline waits (mcore_rl.parallel.failure).
        no_grad = torch.no_grad() if forward_only else nullcontext()
        real = [mb for mb in micro_batches if not isinstance(mb, FillerMicroBatch)]
        tokens = [model_input(mb)[0].numel() for mb in real]
        router = router_loss_scope(self.arch, self.ctx, self.config, tokens, forward_only)
        base = adapters_disabled(self.chunks) if self.adapters_off else nullcontext()
        with self.ctx.guard("forward" if forward_only else "forward_backward"), no_grad, router, base:
            records = get_forward_backward_func()(
                forward_step_func=partial(
                    forward_step, self.ctx, loss_fn, self.routing, self.keep_logits_bytes
                ),
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=micro_batches[0].tokens.shape[0],
                forward_only=forward_only,
            )
            if self.routing is not None:
                self.routing.clear()
            if not forward_only:
                self.router_losses = read_router_losses(self.arch, self.ctx, self.config, len(real))
        return [r for r in records if r is not FILLER_RECORD]

    def finite_or_skip(self, local_metrics: torch.Tensor, on_nonfinite: str, what: str) -> bool:
        """Collective, before the optimizer step: True when every rank's ``local_metrics`` (its loss terms) and
        gradients are finite. Otherwise the gradients are dropped and, as ``on_nonfinite`` says, the step is
        skipped (False: the caller counts it) or :class:`NonFiniteLossError` names the rank and ``what``. Every
        rank takes the same branch (a MAX all-reduce), so no collective of the optimizer step is left waiting.
        The gradients are checked here because megatron's fp32 and bf16 optimizers have no grad scaler to find
        an overflow: a finite loss whose backward overflowed would otherwise step Adam into NaN weights."""
        loss_bad = not bool(torch.isfinite(local_metrics).all())
        grads_bad = not loss_bad and not self._grads_finite()
        bad = torch.tensor([1.0 if loss_bad or grads_bad else 0.0])
        self.ctx.all_reduce(bad, op="max")
        if not bad.item():
            return True
        self.zero_grad()
        if on_nonfinite == "skip":
            return False
        if loss_bad:
            problem = f"NaN/inf {what} {local_metrics.tolist()}"
        elif grads_bad:
            problem = f"a NaN/inf gradient (the {what} was finite)"
        else:
            problem = f"a NaN/inf {what} or gradient on another rank"
        raise NonFiniteLossError(f"rank {self.ctx.rank}: {problem}; the update was not applied")

    def _grads_finite(self) -> bool:
        """This rank's gradients (megatron's ``main_grad`` buffers, reduced over data parallelism) finite."""
        grads: list[torch.Tensor] = []
        for chunk in self.chunks:
            for p in chunk.parameters():
                grad = getattr(p, "main_grad", None)
                grad = p.grad if grad is None else grad
                if p.requires_grad and grad is not None and grad.numel():
                    grads.append(grad)
        return not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())

    def seed_dropout(self, optimizer_step: int) -> None:
        """megatron's dropout streams (its RNG tracker: LoRA dropout, hidden and attention dropout) from the run
        seed and ``optimizer_step``, the number of updates before this one, which a checkpoint restores (the
        LR schedule's count): what an update draws then depends on its index alone, so a resumed or recovered
        run draws what an uninterrupted one did, without RNG states in the checkpoint (whose layout may
        change). Collective-free; every rank of the update calls it with the same step."""
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(
            (self.ctx.seed + 1_000_003 * (optimizer_step + 1)) % 2**31
        )

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> StepResult:
        with self.ctx.guard("optimizer_step"):
            update_successful, grad_norm, _ = self.optimizer.step()
        return StepResult(bool(update_successful), float(grad_norm if grad_norm is not None else 0.0))

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn[M] | HeadLoss[M]
    ) -> tuple[StepResult, list[M]]:
        """zero grads -> forward/backward over all micro-batches -> optimizer step."""
        self.zero_grad()
        metrics = self.forward_backward(micro_batches, loss_fn)
        return self.step(), metrics
