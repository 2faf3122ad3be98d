"""Model checkpoints: save at one layout, load at others (vocab padding included); our info file."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.checkpoint import MODEL_INFO_FILE, ModelCheckpointInfo, load_model, save_model
from mcore_rl.engine.model import ModelOptions, build_model_chunks
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
from mcore_rl.engine.trainer_checkpoint import (
    TRAINER_STATE_FILE,
    load_training_checkpoint,
    read_trainer_state,
    save_training_checkpoint,
)
from mcore_rl.engine.weights import gather_full_state, load_full_state
from mcore_rl.io.errors import ConfigError, InputError, OutputError, UnsafeInputError
from mcore_rl.io.output import MARKER_FILE
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch

LOAD_LAYOUTS = {
    "tp1-dp2": ({}, {}),
    "pp2": ({"pipeline_model_parallel_size": 2}, {}),
    "pp2-vpp2": ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, {}),
    # A different padded vocab (400 rows) than saved (256): the overlap loads, padding starts at zero.
    "tp2-vocab-pad-100": ({"tensor_model_parallel_size": 2}, {"make_vocab_size_divisible_by": 100}),
}


def _save_then_load_everywhere(family: str, directory: str) -> dict[str, bool]:
    arch = tiny_arch(family)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        full = gather_full_state(build_model_chunks(arch, ctx), arch, ctx)  # random, identical on all ranks
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        chunks = build_model_chunks(arch, ctx)
        load_full_state(chunks, full, arch, ctx)
        save_model(chunks, ctx, directory, ModelCheckpointInfo.for_arch(arch, torch.float32))
    same = {}
    for name, (parallel, options) in LOAD_LAYOUTS.items():
        with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
            chunks = build_model_chunks(arch, ctx, ModelOptions(**options))
            load_model(chunks, ctx, directory)
            loaded = gather_full_state(chunks, arch, ctx)
            same[name] = sorted(loaded) == sorted(full) and all(torch.equal(loaded[k], full[k]) for k in full)
            if "vocab" in name:
                embedding = chunks[0].embedding.word_embeddings.weight
                padding = embedding[arch.vocab_size - ctx.tp_rank * embedding.shape[0] :]
                same[name] &= bool((padding == 0).all()) if ctx.tp_rank == 1 else True
    # Virtual pipeline chunks save under model0/model1 with global keys: the same checkpoint layout.
    vpp = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    with ParallelContext.initialize(ParallelConfig(**vpp)) as ctx:
        chunks = build_model_chunks(arch, ctx)
        load_full_state(chunks, full, arch, ctx)
        save_model(chunks, ctx, directory + "-vpp")
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        chunks = build_model_chunks(arch, ctx)
        load_model(chunks, ctx, directory + "-vpp")
        loaded = gather_full_state(chunks, arch, ctx)
        same["saved-at-pp2-vpp2"] = all(torch.equal(loaded[k], full[k]) for k in full)
    dist.barrier()
    return same


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_saved_at_tp2_loads_at_other_layouts(run_distributed, tmp_path, family):
    for per_rank in run_distributed(_save_then_load_everywhere, family, str(tmp_path / "ckpt")):
        assert per_rank == dict.fromkeys([*LOAD_LAYOUTS, "saved-at-pp2-vpp2"], True)
    info = ModelCheckpointInfo.read(str(tmp_path / "ckpt"))
    assert info is not None and info.arch == tiny_arch(family) and info.torch_dtype is torch.float32


def test_info_file(tmp_path):
    assert ModelCheckpointInfo.read(str(tmp_path)) is None
    info = ModelCheckpointInfo.for_arch(tiny_arch("mistral"), torch.bfloat16, converted_from="/x")
    info.write(str(tmp_path))
    assert ModelCheckpointInfo.read(str(tmp_path)) == info
    # The stored dtype wins over the HF config's (weights converted with --dtype bf16 from fp32).
    assert (
        ModelCheckpointInfo.for_arch(tiny_arch(torch_dtype="float32"), torch.bfloat16).hf_config[
            "torch_dtype"
        ]
        == "bfloat16"
    )
    raw = json.loads((tmp_path / MODEL_INFO_FILE).read_text())
    (tmp_path / MODEL_INFO_FILE).write_text(json.dumps({**raw, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99"):
        ModelCheckpointInfo.read(str(tmp_path))


def test_load_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(InputError, match="not a megatron distributed checkpoint"):
        load_model([], None, str(tmp_path))  # type: ignore[arg-type]


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loaders_refuse_a_crafted_checkpoint_before_anything_runs(tmp_path):
    """load_model and the training-checkpoint loader read a crafted ``.metadata`` through the restricted
    unpickler (checked before anything collective, so every rank refuses alike)."""
    ran = tmp_path / "ran"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (ckpt / ".metadata").write_bytes(pickle.dumps(_CreatesFile(str(ran))))
    (ckpt / TRAINER_STATE_FILE).write_text(json.dumps({"step": 1, "layout": LAYOUT, "extra": {}}))
    with pytest.raises(UnsafeInputError, match=r"\.metadata: refers to io\.open"):
        load_model([], None, str(ckpt))  # type: ignore[arg-type]
    with pytest.raises(UnsafeInputError, match=r"\.metadata: refers to io\.open"):
        load_training_checkpoint(None, str(ckpt))
    assert not ran.exists()


LAYOUT = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}


@pytest.mark.parametrize(
    "state, message",
    [
        ({"step": "3", "layout": LAYOUT}, "step must be an integer"),
        ({"step": -1, "layout": LAYOUT}, "step must be an integer >= 0"),
        ({"step": True, "layout": LAYOUT}, "step must be an integer"),
        ({"step": 1, "layout": []}, "layout must be an object"),
        ({"step": 1, "layout": {**LAYOUT, "tensor_parallel_size": 0}}, "layout.tensor_parallel_size"),
        ({"step": 1, "layout": LAYOUT, "extra": [1]}, "extra must be an object"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_trainer_state_fields_are_checked(tmp_path, state, message):
    (tmp_path / TRAINER_STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=f"{TRAINER_STATE_FILE}: {message}"):
        read_trainer_state(str(tmp_path))


def _batch(vocab_size: int, seed: int) -> MicroBatch:
    """Two random sequences of 8 tokens, for the training-engine checkpoint tests."""
    tokens = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    return MicroBatch(tokens, torch.arange(8).expand(2, 8))


def _loss(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return output.float().logsumexp(-1).mean(), {}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _engine_save_train_load(directory: str) -> dict[str, float]:
    """A bf16 TP2 engine trains and saves; a TP1xDP2 engine loads it: the same weights, and a zero-lr step keeps
    them (the fp32 main params were refreshed from the load, not left at the engine's random init)."""
    bf16 = ModelOptions(dtype=torch.bfloat16)

    arch = tiny_arch("llama")
    batch = _batch(arch.vocab_size, 0)
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        engine = TrainEngine.build(arch, ctx, bf16, OptimConfig(weight_decay=0.0, lr=1e-2))
        engine.train_step([batch], _loss)
        engine.save_model(directory)
        trained = gather_full_state(engine.models, arch, ctx)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx, bf16, OptimConfig(weight_decay=0.0, lr=0.0))
        engine.load_model(directory)
        loaded = gather_full_state(engine.models, arch, ctx)
        engine.train_step([batch], _loss)
        stepped = gather_full_state(engine.models, arch, ctx)
    return {"load": _max_diff(loaded, trained), "step": _max_diff(stepped, trained)}


def test_train_engine_saves_and_loads_across_layouts(run_distributed, tmp_path):
    for diffs in run_distributed(_engine_save_train_load, str(tmp_path / "ckpt")):
        assert diffs == {"load": 0.0, "step": 0.0}


def _resume_matches_uninterrupted(
    directory: str, parallel: dict, resume_parallel: dict, family: str = "llama"
) -> float:
    """Train 2 steps, checkpoint, train 1 more; a fresh engine restored from the checkpoint and trained 1 step
    must reach the same weights (Adam moments and step count restored, not just the weights)."""
    arch = tiny_arch(family)
    optim = OptimConfig(weight_decay=0.0, lr=1e-2, adam_beta2=0.99)

    with ParallelContext.initialize(ParallelConfig(**parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=optim)
        for step in range(2):
            engine.train_step([_batch(arch.vocab_size, step)], _loss)
        save_training_checkpoint(engine, directory, step=2, extra={"consumed_prompts": 64})
        engine.train_step([_batch(arch.vocab_size, 2)], _loss)
        uninterrupted = gather_full_state(engine.models, arch, ctx)
    with ParallelContext.initialize(ParallelConfig(**resume_parallel)) as ctx:
        engine = TrainEngine.build(arch, ctx, optim=optim)
        step, extra = load_training_checkpoint(engine, directory)
        assert (step, extra) == (2, {"consumed_prompts": 64})
        engine.train_step([_batch(arch.vocab_size, 2)], _loss)
        resumed = gather_full_state(engine.models, arch, ctx)
    return _max_diff(resumed, uninterrupted)


@pytest.mark.parametrize(
    "parallel, resume_parallel",
    [
        ({}, {}),
        ({"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 2}),
        ({}, {"pipeline_model_parallel_size": 2}),
    ],
    ids=["dp2", "tp2", "dp2-to-pp2"],
)
def test_training_checkpoint_resumes_exactly(run_distributed, tmp_path, parallel, resume_parallel):
    diffs = run_distributed(_resume_matches_uninterrupted, str(tmp_path / "ckpt"), parallel, resume_parallel)
    assert max(diffs) < 1e-6, diffs


def test_moe_training_checkpoint_resumes_exactly_at_ep2(run_distributed, tmp_path):
    """Experts' weights and Adam state (sharded over the expert-data-parallel group) come back exactly."""
    ep2 = {"expert_model_parallel_size": 2}
    diffs = run_distributed(_resume_matches_uninterrupted, str(tmp_path / "ckpt"), ep2, ep2, "qwen3_moe")
    assert max(diffs) < 1e-6, diffs


def _resume_at_another_tp(directory: str) -> str:
    arch = tiny_arch("llama")
    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)) as ctx:
        save_training_checkpoint(TrainEngine.build(arch, ctx), directory, step=0)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx)
        with pytest.raises(ValueError, match="tensor_model_parallel_size=2") as err:
            load_training_checkpoint(engine, directory)
        return str(err.value)


def test_training_checkpoint_refuses_another_tp(run_distributed, tmp_path):
    run_distributed(_resume_at_another_tp, str(tmp_path / "ckpt"))
    with pytest.raises(InputError, match="not a training checkpoint"):
        load_training_checkpoint(None, str(tmp_path))  # checked before anything collective


def _save_before_the_first_step_changes_nothing(directory: str, distributed: bool) -> list[float]:
    """Saving before the first optimizer step leaves that step as it was, and the checkpoint resumes (torch
    Adam's step 0 is not saved by megatron: the load failed with KeyError 'step') into the same first step."""
    arch = tiny_arch("llama")
    optim = OptimConfig(weight_decay=0.0, lr=1e-2, use_distributed_optimizer=distributed)
    states = []
    for action in ("none", "save", "load"):
        with ParallelContext.initialize(ParallelConfig()) as ctx:
            engine = TrainEngine.build(arch, ctx, optim=optim)
            if action == "save":
                save_training_checkpoint(engine, directory, step=0)
            if action == "load":
                assert load_training_checkpoint(engine, directory)[0] == 0
            engine.train_step([_batch(arch.vocab_size, 0)], _loss)
            states.append(gather_full_state(engine.models, arch, ctx))
    return [_max_diff(states[0], states[1]), _max_diff(states[0], states[2])]


@pytest.mark.parametrize("distributed", [False, True], ids=["torch-adam", "distributed-optimizer"])
def test_training_checkpoint_before_the_first_step(run_distributed, tmp_path, distributed: bool):
    results = run_distributed(
        _save_before_the_first_step_changes_nothing, str(tmp_path / "ckpt"), distributed
    )
    assert results == [[0.0, 0.0], [0.0, 0.0]]


def _reaped_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _save_next_to_users_folders(directory: str) -> tuple[int, list[str]]:
    """Saves next to a user's ``<dir>.old`` / ``<dir>.tmp-2`` and over a crashed save of ours; refuses a
    regular file and a folder that is not ours (on every rank, nothing waits)."""
    arch = tiny_arch("llama")
    parent = os.path.dirname(directory)
    failures = []
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(arch, ctx)
        save_training_checkpoint(engine, directory, step=1)
        if ctx.rank == 0:  # a user's backups next to it, and what a save killed halfway leaves behind
            for name in (".old", ".tmp-2"):
                os.makedirs(directory + name)
                with open(os.path.join(directory + name, "mine.txt"), "w") as f:
                    f.write("the user's")
            stale = os.path.join(
                parent, f".{os.path.basename(directory)}.mcore_rl-staging-{_reaped_pid()}-deadbeef"
            )
            os.makedirs(stale)
            marker = {
                "tool": "mcore_rl",
                "target": os.path.realpath(directory),
                "pid": _reaped_pid(),
                "host": socket.gethostname(),
            }
            with open(os.path.join(stale, MARKER_FILE), "w") as f:
                json.dump(marker, f)
            with open(directory + ".file", "w") as f:
                f.write("a user's file")
        dist.barrier()
        save_training_checkpoint(engine, directory, step=2)
        step, _ = load_training_checkpoint(engine, directory)
        for target in (directory + ".file", directory + ".old"):
            try:
                save_training_checkpoint(engine, target, step=3)
            except OutputError as err:
                failures.append(str(err))
        dist.barrier()
        return step, failures


def test_training_checkpoint_never_touches_what_is_not_ours(run_distributed, tmp_path):
    directory = str(tmp_path / "ckpt")
    for step, failures in run_distributed(_save_next_to_users_folders, directory):
        assert step == 2
        assert "ckpt.file exists and is not a folder" in failures[0]
        assert "ckpt.old exists and was not written by mcore_rl" in failures[1]
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt",
        "ckpt.file",
        "ckpt.old",
        "ckpt.tmp-2",
    ]  # stale staging gone
    for name in ("ckpt.old", "ckpt.tmp-2"):
        assert (tmp_path / name / "mine.txt").read_text() == "the user's"
    assert (tmp_path / "ckpt.file").read_text() == "a user's file"
