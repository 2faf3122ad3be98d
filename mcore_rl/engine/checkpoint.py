"""Model checkpoints in megatron-core's distributed format (``dist_checkpointing``, torch_dist backend).

A checkpoint folder holds megatron's files (``.metadata``, ``__<rank>_<i>.distcp``, ``common.pt``,
``metadata.json``) plus :data:`MODEL_INFO_FILE`, ours: the HF config and real vocabulary size, so that
``mcore-rl convert mcore-to-hf`` needs nothing else, and :data:`HF_ASSETS_DIR` with tokenizer files
when they were known. The format is reshardable: a checkpoint saved at one (TP, PP, VPP) loads at any
other, vocab padding included (megatron marks the embedding/output rows ``allow_shape_mismatch``).

The functions are small on purpose: the trainer's full checkpoint (optimizer, RNG, step) adds its own
entries next to :func:`sharded_state_dict`'s and calls ``dist_checkpointing`` once, passing
:func:`save_strategy` as ``sharded_strategy``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.weights import unwrap
from mcore_rl.io.checkpoint_read import check_common_pt, read_dcp_metadata, safe_dcp_loading
from mcore_rl.io.collective import abort_collective, begin_collective, commit_collective
from mcore_rl.io.errors import ConfigError, InputError
from mcore_rl.io.inputs import check_input_tree, input_file, read_json_object
from mcore_rl.io.output import OutputFolder
from mcore_rl.io.side_files import copy_model_assets
from mcore_rl.parallel.context import ParallelContext

MODEL_INFO_FILE = "mcore_rl_model.json"
HF_ASSETS_DIR = "hf_assets"
FORMAT_VERSION = 1
ADAPTERS_ONLY = "lora_adapters_only"
"""``ModelCheckpointInfo.extra`` key of a LoRA run checkpoint: its adapters (this spec), not the model's weights."""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
STORABLE_DTYPES = tuple(_DTYPE_NAMES)
"""Weight dtypes a model checkpoint stores (what :attr:`ModelCheckpointInfo.dtype` can name)."""


@dataclass(frozen=True)
class ModelCheckpointInfo:
    """What a checkpoint holds, beyond megatron's tensors (written as :data:`MODEL_INFO_FILE`)."""

    hf_config: dict[str, Any]
    """The model's HF ``config.json`` (architecture, vocab, rope, ...)."""
    dtype: str
    """Stored weight dtype: 'float32', 'bfloat16' or 'float16'."""
    format_version: int = FORMAT_VERSION
    """Version of this file's layout; a reader refuses another."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (e.g. the HF folder it was converted from)."""

    @classmethod
    def for_arch(cls, arch: ModelArch, dtype: torch.dtype, **extra: Any) -> ModelCheckpointInfo:
        """The info of ``arch`` stored as ``dtype``; the config's own dtype field (if any) says the same."""
        hf_config = dict(arch.extra)
        for key in ("dtype", "torch_dtype"):
            if key in hf_config:
                hf_config[key] = _DTYPE_NAMES[dtype]
        return cls(hf_config=hf_config, dtype=_DTYPE_NAMES[dtype], extra=extra)

    @property
    def arch(self) -> ModelArch:
        return ModelArch.from_hf_config(self.hf_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {v: k for k, v in _DTYPE_NAMES.items()}[self.dtype]

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, MODEL_INFO_FILE), "w") as f:
            json.dump(asdict(self), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def read(cls, directory: str) -> ModelCheckpointInfo | None:
        """The info of a checkpoint folder, or None when it has none (not written by mcore_rl).

        Every field is type-checked; an error names the file and the field."""
        if not os.path.lexists(os.path.join(directory, MODEL_INFO_FILE)):
            return None
        path = str(input_file(directory, MODEL_INFO_FILE))
        raw = read_json_object(path)
        unknown = sorted(set(raw) - {"hf_config", "dtype", "format_version", "extra"})
        if unknown:
            raise ConfigError(f"{path}: unknown field {unknown[0]!r}")
        version = raw.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ConfigError(f"{path}: format_version={version!r}, expected {FORMAT_VERSION}")
        if raw.get("dtype") not in _DTYPE_NAMES.values():
            raise ConfigError(
                f"{path}: dtype={raw.get('dtype')!r}, expected one of {list(_DTYPE_NAMES.values())}"
            )
        for name in ("hf_config", "extra"):
            if not isinstance(raw.get(name, {}), dict):
                raise ConfigError(f"{path}: {name} must be an object, got {raw[name]!r}")
        if "hf_config" not in raw:
            raise ConfigError(f"{path}: missing field 'hf_config'")
        try:
            ModelArch.from_hf_config(raw["hf_config"])
        except ConfigError as err:
            raise ConfigError(f"{path}: hf_config: {str(err).removeprefix('config: ')}") from None
        return cls(**raw)


StateFilter = Callable[[dict[str, Any]], dict[str, Any]]
"""What part of one chunk's sharded state dict is saved or loaded (LoRA: ``engine/lora.py``)."""


def sharded_state_dict(chunks: list[Any], part: StateFilter | None = None) -> dict[str, Any]:
    """megatron's sharded state dict of this rank's model chunks (``part`` of each chunk's, when given).

    Same top-level keys as Megatron-LM: ``model``, or ``model0``, ``model1``, ... with virtual pipeline
    chunks. Tensor keys inside are global (layer numbers included), so the stored checkpoint does not
    depend on the layout.
    """
    models = [unwrap(c) for c in chunks]
    states = [m.sharded_state_dict() for m in models]
    return {name: part(s) if part else s for name, s in zip(model_keys(len(models)), states, strict=True)}


def model_keys(num_chunks: int) -> list[str]:
    """Top-level checkpoint keys of the model chunks: ``model``, or ``model0``, ``model1``, ... (Megatron-LM's)."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


class _OwnStagingFolder(logging.Filter):
    """megatron warns "Overwriting old incomplete / corrupted checkpoint..." whenever the folder it saves into is
    not empty. Ours never is: the staging folder holds its ownership marker (``io/output.py``) from the start,
    so every save printed that false alarm once per checkpoint."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete" not in record.getMessage()


def quiet_staging_warning() -> None:
    """Install :class:`_OwnStagingFolder` on megatron's checkpoint logger (once)."""
    log = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    if not any(isinstance(f, _OwnStagingFolder) for f in log.filters):
        log.addFilter(_OwnStagingFolder())


def save_strategy() -> Any:
    """A torch_dist save strategy that writes in this process (same on-disk format as megatron's default).

    megatron's default writer starts a ``multiprocessing`` Manager and forks writer processes for every
    save: that cannot run in a daemonic process (a multiprocessing pool worker, such as our test pool),
    hangs scripts without an ``if __name__ == "__main__"`` guard, and costs seconds to start. torch's own
    DCP ``FileSystemWriter`` writes the same files synchronously. (Asynchronous saving, when the trainer
    wants it, is megatron's ``async_sharded_save`` path.)

    A subclass of megatron's own torch_dist strategy: from megatron-core 0.17 ``save()`` replaces any other
    strategy with its default writer (silently), and 0.19 removed ``strategies/base.py``.
    """
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("torch_dist", 1)

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            import torch.distributed.checkpoint as dcp
            from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

            by_key, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, keep_only_main_replica=True
            )
            dcp.save(
                mcore_torch.mcore_to_pyt_state_dict(by_key, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=mcore_torch.MCoreSavePlanner(
                    dedup_replicated_tensors=False, flatten_state_dict=False
                ),
            )

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

    return InProcessTorchDistSave()


def save_model(
    chunks: list[Any],
    ctx: ParallelContext,
    directory: str,
    info: ModelCheckpointInfo | None = None,
    part: StateFilter | None = None,
    assets: tuple[str | None, str | None] = (None, None),
) -> None:
    """Collective: every rank writes its shards of the model; ``directory`` appears complete at the end, with
    the tokenizer and generation files of ``assets`` (its tokenizer folder, its model folder:
    :func:`~mcore_rl.io.side_files.copy_model_assets`) in :data:`HF_ASSETS_DIR`.

    It replaces an earlier checkpoint of ours there, never a folder that is not ours (see
    :class:`~mcore_rl.io.output.OutputFolder`)."""
    from megatron.core import dist_checkpointing

    quiet_staging_warning()
    output, staging = begin_collective(
        lambda: OutputFolder.plan(
            directory, flag="checkpoint folder", replace_ours=True, kind="model-checkpoint"
        ),
        ctx.rank,
    )
    try:
        dist_checkpointing.save(sharded_state_dict(chunks, part), staging, sharded_strategy=save_strategy())
    except BaseException:
        abort_collective(output, ctx.rank)
        raise

    def finish() -> None:
        if info is not None:
            info.write(staging)
        copy_model_assets(*assets, os.path.join(staging, HF_ASSETS_DIR))

    commit_collective(output, ctx.rank, finish)


def check_checkpoint_folder(directory: str) -> None:
    """Before megatron reads ``directory``: a complete checkpoint (every data file its metadata names, each as
    long as the metadata needs, and ``common.pt``), no link out of it, a safe ``common.pt``."""
    check_input_tree(directory, "checkpoint folder")
    if not os.path.isfile(os.path.join(directory, "metadata.json")):  # megatron's completion marker
        raise InputError(f"{directory}: not a megatron distributed checkpoint (no metadata.json)")
    read_json_object(os.path.join(directory, "metadata.json"))
    metadata = read_dcp_metadata(directory)
    if os.path.lexists(os.path.join(directory, "common.pt")):
        check_common_pt(directory)
    elif not any(k.split("/")[0] == COMMON_STATE_KEY for k in metadata.state_dict_metadata):
        raise InputError(f"{directory}: common.pt is missing (an incomplete copy of the checkpoint?)")


COMMON_STATE_KEY = "common_state"
"""Where megatron-core 0.19+ keeps a checkpoint's common state: a sharded object among the ``*.distcp`` data
(up to 0.18 it wrote ``common.pt``, which 0.19+ still reads where present)."""


SHAPELESS_ARCH_FIELDS = frozenset(
    {
        "family",
        "max_position_embeddings",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "partial_rotary_factor",
        "sliding_window",
        "initializer_range",
        "extra",
    }
)
"""ModelArch fields that no weight's shape depends on; every other field (a new one too) must match to load."""


def check_same_model(directory: str, arch: ModelArch) -> None:
    """A checkpoint saved for another model is refused naming the fields that differ (from its
    :data:`MODEL_INFO_FILE`; without one, megatron's own shape check names the tensor)."""
    info = ModelCheckpointInfo.read(directory)
    if info is None:
        return
    saved = info.arch
    differ = [
        f"{f.name}={getattr(saved, f.name)!r} saved, {getattr(arch, f.name)!r} here"
        for f in fields(ModelArch)
        if f.name not in SHAPELESS_ARCH_FIELDS and getattr(saved, f.name) != getattr(arch, f.name)
    ]
    if differ:
        raise InputError(f"{directory}: saved for another model ({'; '.join(differ)})")


@torch.no_grad()
def load_model(
    chunks: list[Any], ctx: ParallelContext, directory: str, part: StateFilter | None = None
) -> None:
    """Collective: load this rank's shards (``part`` of them) from a model checkpoint saved at any layout.

    The checkpoint is untrusted data: its metadata goes through a restricted unpickler and its objects load
    with ``weights_only=True`` (:mod:`mcore_rl.io.checkpoint_read`)."""
    check_checkpoint_folder(directory)
    info = ModelCheckpointInfo.read(directory)
    if info is not None and ADAPTERS_ONLY in info.extra:
        raise InputError(
            f"{directory}: a LoRA run checkpoint holds the adapters, not the model; write the model with "
            f"mcore-rl convert mcore-to-hf --ckpt {directory} --merge-lora --base BASE_HF_DIR --out DIR"
        )
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    request = sharded_state_dict(chunks, part)
    with safe_dcp_loading(directory):
        loaded, _, unexpected = dist_checkpointing.load(
            request, directory, strict=StrictHandling.RETURN_UNEXPECTED
        )
    # Transformer-Engine layers keep fp8 bookkeeping in ``_extra_state``; a checkpoint from the local spec
    # (CPU, conversion) has none for some of them, and TE starts fresh without it. Weights must all be there.
    missing_weights = sorted(k for k in unexpected if "_extra_state" not in k)
    if missing_weights:
        raise KeyError(f"{directory}: checkpoint lacks {missing_weights}")
    load_model_state(chunks, loaded, directory, part)


def load_model_state(
    chunks: list[Any], loaded: dict[str, Any], directory: str, part: StateFilter | None = None
) -> None:
    """The model part of a loaded checkpoint dict into ``chunks``; every weight (of ``part``) must match (TE's
    ``_extra_state`` may be absent)."""
    models = [unwrap(c) for c in chunks]
    for name, model in zip(model_keys(len(models)), models, strict=True):
        result = model.load_state_dict(loaded[name], strict=False)
        wanted = set(part(dict.fromkeys(result.missing_keys))) if part else set(result.missing_keys)
        absent = [k for k in result.missing_keys if "_extra_state" not in k and k in wanted]
        if absent or result.unexpected_keys:
            raise KeyError(
                f"{directory}: state mismatch, missing {absent}, unexpected {result.unexpected_keys}"
            )
