"""Bad input, table-driven: each case ends in one error line naming the item, the documented exit code, and
every file that existed before byte-identical afterwards (nothing added, nothing removed, nothing changed).

Cases run ``mcore_rl.cli.main`` in-process inside a scratch workspace (tests/convert/bad_inputs.py). The
classes: launcher environment, output safety, untrusted checkpoints, config.json and our metadata files,
weights, flags, demo flags. Other failure paths (midway failures, --debug, overwrite) are in test_failures.py.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
from collections.abc import Iterator

import pytest

from mcore_rl.cli import main
from tests.convert.bad_inputs import (
    Case,
    Workspace,
    _c,
    config,
    config_without,
    crafted_eval,
    crafted_metadata,
    existing,
    file_size_limit,
    first_shard,
    float64_weights,
    given_config,
    hf_config_field,
    latin1_in_row,
    link,
    metadata_escaping_storage,
    mocked,
    model_info,
    nan_weight,
    row_set,
    row_without,
    side_file_link,
    signal_inside_save,
    snapshot,
    to_hf,
    to_mcore,
    train_on,
)

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes", "demo_cpu.yaml")


def train(*overrides: str) -> list[str]:
    """``mcore-rl train`` of the main job's recipe with ``overrides``, in this process."""
    return ["train", RECIPE, *overrides, "--in-process"]


CASES = [
    # First: they need a process without a torch.distributed world (later cases may leave one behind).
    # --- launcher environment --------------------------------------------------------------------------------
    _c("world-without-launcher", to_hf, "WORLD_SIZE=2", "torchrun", env={"WORLD_SIZE": "2", "RANK": "1"}),
    _c("world-not-int", to_hf, "WORLD_SIZE='two'", env={"WORLD_SIZE": "two"}),
    _c(
        "rank-beyond-world",
        to_hf,
        "RANK=5",
        env={
            "WORLD_SIZE": "2",
            "RANK": "5",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
    ),
    _c("rendezvous-missing", to_hf, "MASTER_ADDR", env={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}),
    # --- output safety ---------------------------------------------------------------------------------------
    _c("out-empty-hf", lambda ws: to_mcore(ws, "--overwrite", out=""), "--out is empty"),
    _c("out-empty-mcore", lambda ws: to_hf(ws, "--overwrite", out=""), "--out is empty"),
    _c("out-blank", lambda ws: to_hf(ws, out="  "), "--out is empty"),
    _c("out-dot", lambda ws: to_hf(ws, "--overwrite", out="."), "--out .", "current directory"),
    _c("out-cwd-abs", lambda ws: to_mcore(ws, "--overwrite", out=ws.p("cwd")), "current directory"),
    _c("out-cwd-parent", lambda ws: to_hf(ws, "--overwrite", out=".."), "contains the current directory"),
    _c("out-home", lambda ws: to_hf(ws, "--overwrite", out=ws.p("home")), "home folder"),
    _c("out-tilde-parent", lambda ws: to_hf(ws, "--overwrite", out=ws.root), "contains"),
    _c("out-root", lambda ws: to_hf(ws, "--overwrite", out="/"), "filesystem root"),
    _c("out-is-input", lambda ws: to_mcore(ws, "--overwrite", out=ws.hf), "is the input"),
    _c("out-is-ckpt", lambda ws: to_hf(ws, "--overwrite", out=ws.ck), "is the input"),
    _c(
        "out-inside-input",
        lambda ws: to_hf(ws, "--overwrite", out=os.path.join(ws.ck, "x")),
        "inside the input",
    ),
    _c(
        "out-contains-input",
        lambda ws: to_mcore(ws, "--overwrite", out=os.path.dirname(ws.hf) + "/./"),
        "contains",
    ),
    _c(
        "out-via-symlinked-parent",
        lambda ws: (link(ws, "alias", ws.hf), to_mcore(ws, "--overwrite", out=ws.p("alias", "sub")))[1],
        "inside the input",
    ),
    _c(
        "out-symlink-to-input",
        lambda ws: (link(ws, "alias", ws.hf), to_mcore(ws, "--overwrite", out=ws.p("alias")))[1],
        "symbolic link",
    ),
    _c(
        "out-is-hf-config-from",
        lambda ws: to_hf(ws, "--hf-config-from", ws.hf, "--overwrite", out=ws.hf),
        "is the input",
    ),
    _c(
        "out-contains-hf-config-from",
        lambda ws: (
            shutil.copytree(ws.hf, ws.p("models", "hf")),
            to_hf(ws, "--hf-config-from", ws.p("models", "hf"), "--overwrite", out=ws.p("models")),
        )[1],
        "contains the input",
    ),
    _c("out-exists-hf", lambda ws: (existing(ws), to_mcore(ws))[1], "not empty", "--overwrite"),
    _c("out-exists-mcore", lambda ws: (existing(ws), to_hf(ws))[1], "not empty", "--overwrite"),
    _c("out-ours-no-overwrite", lambda ws: (existing(ws, True), to_hf(ws))[1], "not empty", "--overwrite"),
    _c(
        "out-is-a-file",
        lambda ws: (ws.write("out", "a user's file"), to_hf(ws, "--overwrite"))[1],
        "not a folder",
    ),
    _c(
        "out-parent-missing", lambda ws: to_hf(ws, out=ws.p("nope", "out")), "parent folder", "does not exist"
    ),
    _c("out-name-too-long", lambda ws: to_hf(ws, out=ws.p("x" * 300)), "longer than 255"),
    _c(
        "out-read-only",
        mocked("mcore_rl.io.output.os.mkdir", OSError(errno.EROFS, "Read-only file system", "/ro/out")),
        "/ro/out",
        "Read-only file system",
    ),
    _c(
        "out-disk-full",
        mocked(
            "mcore_rl.engine.hf.safetensors_io.StreamingShardWriter.add",
            OSError(errno.ENOSPC, "No space left"),
        ),
        "No space left",
    ),
    _c(
        "permission-denied",
        mocked("builtins.open", PermissionError(errno.EACCES, "Permission denied"), to_mcore),
        "config.json: cannot read (Permission denied)",  # the first file opened, named; not "corrupt"
    ),
    # --- untrusted checkpoints -------------------------------------------------------------------------------
    _c("pickle-runs-code", crafted_metadata, ".metadata", "io.open", "refusing"),
    _c("pickle-eval", crafted_eval, ".metadata", "builtins.eval", "refusing"),
    _c(
        "metadata-garbage",
        lambda ws: (ws.write("ck/.metadata", b"\x80\x05garbage"), to_hf(ws))[1],
        ".metadata",
    ),
    _c(
        "metadata-truncated",
        lambda ws: (os.truncate(os.path.join(ws.ck, ".metadata"), 100), to_hf(ws))[1],
        ".metadata",
        "not a readable",
    ),
    _c(
        "metadata-not-metadata",
        lambda ws: (ws.write("ck/.metadata", pickle.dumps({"a": 1})), to_hf(ws))[1],
        ".metadata",
        "holds a dict",
    ),
    _c("metadata-names-outside-file", metadata_escaping_storage, "../secret/id_rsa", "not a file of"),
    _c(
        "metadata-symlink-out",
        lambda ws: (link(ws, "ck/.metadata", ws.secret()), to_hf(ws))[1],
        ".metadata",
        "outside",
    ),
    _c("side-file-symlink-out", side_file_link, "tokenizer.json", "outside"),
    _c(
        "hf-assets-dir-symlink-out",
        lambda ws: (ws.secret(), link(ws, "ck/hf_assets", ws.p("secret")), to_hf(ws))[2],
        "hf_assets",
        "outside",
    ),
    _c(
        "hf-side-file-symlink-out",
        lambda ws: (link(ws, "hf/tokenizer.json", ws.secret()), to_mcore(ws))[1],
        "tokenizer.json",
        "outside",
    ),
    _c(
        "hf-config-symlink-out",
        lambda ws: (
            ws.write("secret/config.json", "{}"),
            link(ws, "hf/config.json", ws.p("secret/config.json")),
            to_mcore(ws),
        )[2],
        "config.json",
        "outside",
    ),
    _c(
        "hf-shard-symlink-out",
        lambda ws: (
            shutil.copy(os.path.join(ws.hf, first_shard(ws)), ws.secret()),
            link(ws, "hf/" + first_shard(ws), ws.p("secret/id_rsa")),
            to_mcore(ws),
        )[2],
        "outside",
    ),
    _c(
        "distcp-truncated",
        lambda ws: (os.truncate(os.path.join(ws.ck, "__0_0.distcp"), 64), to_hf(ws))[1],
        "__0_0.distcp: truncated (64 bytes",
    ),
    _c(
        "metadata-json-garbage", lambda ws: (ws.write("ck/metadata.json", "{"), to_hf(ws))[1], "metadata.json"
    ),
    _c("metadata-json-list", lambda ws: (ws.write("ck/metadata.json", "[]"), to_hf(ws))[1], "JSON object"),
    _c(
        "metadata-json-backend",
        lambda ws: (ws.write("ck/metadata.json", '{"sharded_backend": "zarr"}'), to_hf(ws))[1],
        "sharded_backend='zarr'",
    ),
    _c(
        "not-a-checkpoint",
        lambda ws: ["convert", "mcore-to-hf", "--ckpt", ws.hf, "--out", ws.p("out")],
        "metadata.json",
        "not a megatron",
    ),
    _c(
        "info-garbage",
        lambda ws: (ws.write("ck/mcore_rl_model.json", "nope"), to_hf(ws))[1],
        "mcore_rl_model.json",
    ),
    _c("info-dtype", model_info(dtype="int8"), "mcore_rl_model.json", "dtype='int8'"),
    _c("info-hf-config-type", model_info(hf_config="llama"), "mcore_rl_model.json", "hf_config"),
    _c("info-version-string", model_info(format_version="1"), "format_version='1'"),
    _c("info-unknown-field", model_info(surprise=1), "unknown field 'surprise'"),
    _c(
        "info-tie-string",
        hf_config_field(tie_word_embeddings="false"),
        "mcore_rl_model.json",
        "tie_word_embeddings",
    ),
    _c("info-layers-zero", hf_config_field(num_hidden_layers=0), "mcore_rl_model.json", "num_hidden_layers"),
    # --hf-config-from another model than the checkpoint's: each took rows silently (the vocab "padding" allowed
    # any stored rows >= the config's), or dropped a stored tensor (nothing checked each one was used).
    _c(
        "given-config-classifier",  # the LM head's row 0 became score.weight
        given_config(architectures=["LlamaForSequenceClassification"], num_labels=1),
        "output_layer.weight has shape [256, 64], the config implies [1, 64]",
        "score head",
    ),
    _c(
        "given-config-smaller-vocab",  # 50 real rows dropped
        given_config(vocab_size=200),
        "given/config.json: vocab_size=200",
        "mcore_rl_model.json records vocab_size=250",
    ),
    _c(
        "given-config-tied",  # the trained output layer dropped
        given_config(tie_word_embeddings=True),
        "tensor output_layer.weight has no place in the model",
        "tie_word_embeddings=true",
    ),
    _c(
        "given-config-vocab-not-padding",  # no record to check against: rows must be the padding of the vocab
        given_config(keep_info=False, vocab_size=100, num_key_value_heads=1),
        "embedding.word_embeddings.weight has shape [256, 64]",
        "one of [100, 128]",
    ),
    # --- config.json fields ----------------------------------------------------------------------------------
    _c(
        "tie-string",
        config(tie_word_embeddings="false"),
        "config.json",
        "tie_word_embeddings",
        "true or false",
    ),
    _c("layers-string", config(num_hidden_layers="4"), "config.json", "num_hidden_layers"),
    _c("layers-float", config(num_hidden_layers=4.0), "num_hidden_layers", "positive integer"),
    _c("layers-zero", config(num_hidden_layers=0), "num_hidden_layers"),
    _c("layers-bool", config(num_hidden_layers=True), "num_hidden_layers"),
    _c("hidden-negative", config(hidden_size=-64), "hidden_size"),
    _c("vocab-missing", config_without("vocab_size"), "missing field 'vocab_size'"),
    _c("positions-missing", config_without("max_position_embeddings"), "max_position_embeddings"),
    _c("eps-string", config(rms_norm_eps="1e-6"), "rms_norm_eps"),
    _c("eps-nan", config(rms_norm_eps=float("nan")), "rms_norm_eps"),
    _c("rope-theta-zero", config(rope_theta=0), "rope_theta"),
    _c(
        "rope-llama3-incomplete",
        config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        "rope_parameters.low_freq_factor",
    ),
    _c(
        "rope-linear-no-factor",
        config(rope_parameters=None, rope_scaling={"rope_type": "linear"}),
        "rope_scaling.factor",
    ),
    _c("rope-string", config(rope_parameters="llama3"), "rope_parameters must be an object"),
    _c(
        "rope-longrope",
        config(rope_parameters={"rope_type": "longrope", "factor": 2.0}),
        "rope_type='longrope'",
    ),
    _c(
        "rope-yarn-shrinking",
        config(rope_parameters={"rope_type": "yarn", "factor": 0.5}),
        "rope_parameters.factor must be >= 1 for yarn",
    ),
    _c("attention-bias-string", config(attention_bias="yes"), "attention_bias"),
    _c("kv-heads-not-dividing", config(num_key_value_heads=3), "num_key_value_heads=3"),
    _c("architectures-string", config(architectures="LlamaForCausalLM"), "architectures"),
    _c(
        "architectures-unknown",
        config(architectures=["GPT2LMHeadModel"]),
        "GPT2LMHeadModel",
        "Qwen2ForCausalLM",
    ),
    _c("dtype-number", config(torch_dtype=16), "torch_dtype"),
    _c("partial-rotary-2", config(partial_rotary_factor=2.0), "partial_rotary_factor"),
    _c(
        "mistral-window-string",
        config(architectures=["MistralForCausalLM"], sliding_window="8"),
        "sliding_window",
    ),
    _c(
        "config-garbage",
        lambda ws: (ws.write("hf/config.json", "{nope"), to_mcore(ws))[1],
        "config.json",
        "JSON",
    ),
    _c(
        "config-list",
        lambda ws: (ws.write("hf/config.json", "[1]"), to_mcore(ws))[1],
        "config.json",
        "JSON object",
    ),
    _c(
        "config-missing",
        lambda ws: (os.remove(os.path.join(ws.hf, "config.json")), to_mcore(ws))[1],
        "config.json",
    ),
    _c(
        "config-disagrees-with-weights",
        config(intermediate_size=128),
        "mlp.gate_proj.weight has shape [96, 64]",
        "intermediate_size=128",
    ),
    _c("extra-layers-in-weights", config(num_hidden_layers=2), "model.layers.2.", "num_hidden_layers=2"),
    # --- weights ---------------------------------------------------------------------------------------------
    _c("nan-weight", nan_weight, "NaN/Inf", "--allow-nonfinite"),
    _c("float64-weights", float64_weights, "torch.float64", "--dtype"),
    _c(
        "shard-missing",
        lambda ws: (os.remove(os.path.join(ws.hf, first_shard(ws))), to_mcore(ws))[1],
        "missing",
    ),
    _c(
        "shard-garbage",
        lambda ws: (ws.write("hf/" + first_shard(ws), b"\xff" * 64), to_mcore(ws))[1],
        "corrupt",
    ),
    _c(
        "shard-truncated",
        lambda ws: (os.truncate(os.path.join(ws.hf, first_shard(ws)), 1000), to_mcore(ws))[1],
        "corrupt",
    ),
    _c(
        "shard-is-a-folder",
        lambda ws: (
            shard := os.path.join(ws.hf, first_shard(ws)),
            os.remove(shard),
            os.mkdir(shard),
            to_mcore(ws),
        )[3],
        "not a regular file",
    ),
    _c(
        "index-weight-map-list",
        lambda ws: (ws.write("hf/model.safetensors.index.json", '{"weight_map": []}'), to_mcore(ws))[1],
        "weight_map",
    ),
    _c(
        "index-garbage",
        lambda ws: (ws.write("hf/model.safetensors.index.json", "{"), to_mcore(ws))[1],
        "model.safetensors.index.json",
    ),
    _c(
        "only-bin-weights",
        lambda ws: (
            [os.remove(os.path.join(ws.hf, f)) for f in os.listdir(ws.hf) if "safetensors" in f],
            ws.write("hf/pytorch_model.bin", b"x"),
            to_mcore(ws),
        )[2],
        ".bin",
    ),
    # --- flags -----------------------------------------------------------------------------------------------
    _c("tp-zero", lambda ws: to_mcore(ws, "--tp", "0"), "--tp", "at least 1", code=2),
    _c("tp-word", lambda ws: to_mcore(ws, "--tp", "two"), "--tp", code=2),
    _c("pp-negative", lambda ws: to_mcore(ws, "--pp", "-1"), "--pp", code=2),
    _c(
        "tp-not-dividing-heads",
        lambda ws: to_mcore(ws, "--tp", "3"),
        "num_attention_heads=4",
        "tensor_model_parallel_size=3",
    ),
    _c("dtype-unknown", lambda ws: to_mcore(ws, "--dtype", "fp8"), "--dtype 'fp8'", code=2),
    _c("shard-size-word", lambda ws: to_hf(ws, "--max-shard-size", "big"), "--max-shard-size", code=2),
    _c("shard-size-zero", lambda ws: to_hf(ws, "--max-shard-size", "0"), "--max-shard-size", code=2),
    _c(
        "hf-dir-missing",
        lambda ws: ["convert", "hf-to-mcore", "--hf-dir", ws.p("nope"), "--out", ws.p("out")],
        "--hf-dir",
        "not a folder",
    ),
    _c(
        "ckpt-missing",
        lambda ws: ["convert", "mcore-to-hf", "--ckpt", ws.p("nope"), "--out", ws.p("out")],
        "--ckpt",
        "not a folder",
    ),
    _c("hf-config-from-missing", lambda ws: to_hf(ws, "--hf-config-from", ws.p("nope")), "--hf-config-from"),
    _c("unknown-flag", lambda ws: to_hf(ws, "--frobnicate"), "--frobnicate", code=2),
    # --- the main job's CLI (mcore-rl train) --------------------------------------------------------------------
    _c(
        "train-sft-target-above-1",
        lambda ws: train("sft.target_val_accuracy=1.5"),
        "sft.target_val_accuracy",
    ),
    _c("train-lr-word", lambda ws: train("optim.lr=many"), "optim.lr"),
    _c("train-unknown-key", lambda ws: train("optim.frobnicate=1"), "optim.frobnicate"),
    _c("train-out-cwd", lambda ws: train("trainer.default_local_dir=."), "current directory"),
    _c(
        "train-out-not-ours",
        lambda ws: (existing(ws), train(f"trainer.default_local_dir={ws.p('out')}"))[1],
        "not written by mcore_rl",
    ),
    # --- faults during a conversion (issue 31: found by the probe of the CLI and checkpoint API) --------------
    _c(
        "hf-to-mcore-disk-full",
        file_size_limit(100 << 10, to_mcore),  # the converted shards are ~350 KiB
        "--out",
        "while writing the checkpoint; the partial output was removed",
    ),
    _c("hf-to-mcore-sigint", signal_inside_save(signal.SIGINT), "interrupted by SIGINT", code=130),
    _c("hf-to-mcore-sigterm", signal_inside_save(signal.SIGTERM), "interrupted by SIGTERM", code=143),
    _c("hf-to-mcore-sighup", signal_inside_save(signal.SIGHUP), "interrupted by SIGHUP", code=129),
    # --- bad training data and scorers, refused before the first step (issue 31) ------------------------------
    _c(
        "train-row-missing-column",
        train_on(row_without(2, "reward_model")),
        "train.jsonl: row 2: column 'reward_model.ground_truth': missing",
        "data.skip_bad_rows",
    ),
    _c("train-row-empty-prompt", train_on(row_set(1, prompt="")), "row 1: column 'prompt': empty prompt"),
    _c(
        "train-row-empty-messages",
        train_on(row_set(1, prompt=[{"role": "user", "content": ""}])),
        "row 1: column 'prompt': empty prompt",
    ),
    _c(
        "train-prompt-over-max-length",
        train_on(row_set(3, prompt="1" * 200), "data.max_prompt_length=16"),
        "row 3: column 'prompt': prompt has",
        "data.max_prompt_length=16",
        "data.filter_overlong_prompts",
    ),
    _c("train-row-not-utf8", train_on(latin1_in_row(5)), "train.jsonl: row 5", "not UTF-8 (byte 0xe9"),
    _c(
        "train-ground-truth-dict",
        train_on(row_set(4, reward_model={"ground_truth": {"answer": "975"}})),
        "row 4: column 'reward_model.ground_truth': is a dict",
        "built-in scorer 'exact_match'",
    ),
    _c(
        "train-ground-truth-list",
        train_on(row_set(0, reward_model={"ground_truth": ["975", "579"]})),
        "row 0: column 'reward_model.ground_truth': is a list",
    ),
    _c(
        "train-scorer-wrong-signature",
        train_on(None, scorer="def score(solution, truth):\n    return 1.0\n"),
        "scorer.py:score",
        "cannot be called as fn(data_source, solution_str, ground_truth, extra_info)",
    ),
    _c(
        "train-scorer-fails-on-import",
        train_on(None, scorer="import nonexistent_module_31\n"),
        "scorer.py:score",
        "nonexistent_module_31",
    ),
    _c(
        "train-scorer-no-such-function",
        train_on(None, scorer="def other(a, b, c, d):\n    return 0.0\n"),
        "has no function 'score'",
    ),
    _c(
        "train-sft-batch-larger-than-data",
        train_on(None, "sft.enable=true", "sft.train_batch_size=64", "sft.micro_batch_size_per_gpu=64"),
        "sft.jsonl: 4 usable examples cannot fill one batch of sft.train_batch_size=64",
    ),
]


@pytest.fixture
def workspace(tmp_path, hf_sharded, ckpt, monkeypatch) -> Iterator[Workspace]:
    """A workspace as cwd and HOME; afterwards the environment and torch.distributed are as before (a case
    that gets as far as hf-to-mcore's writing joins a world of one in this process)."""
    import torch.distributed as dist

    ws = Workspace(str(tmp_path / "ws"), hf_sharded, ckpt)
    monkeypatch.chdir(ws.p("cwd"))
    saved_env, had_world = dict(os.environ), dist.is_initialized()
    os.environ["HOME"] = ws.p("home")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(key, None)
    yield ws
    if dist.is_initialized() and not had_world:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)


def _run_case(case: Case, ws: Workspace, capsys, monkeypatch) -> str:
    import torch.distributed as dist

    if case.env and dist.is_initialized():
        # An earlier in-process test's world of one (a ParallelContext leaves the default group for the next one
        # in the process, and builds a world again where there is none). Launcher variables are read only when a
        # world is joined: leave it, so that these cases check them rather than being skipped.
        from mcore_rl.parallel.context import ParallelContext

        assert ParallelContext._active is None, "a ParallelContext is still live in this test process"
        dist.destroy_process_group()
    args = case.build(ws)
    before = snapshot(ws.root)
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    patch = getattr(case.build, "patch", None)
    capsys.readouterr()
    try:
        if patch is not None:
            with patch:
                code = main(args)
        else:
            code = main(args)
    except SystemExit as exit_:  # argparse usage errors exit directly
        code = exit_.code
    err = capsys.readouterr().err
    assert code == case.code, (code, err)
    failed = ("interrupted by",) if case.code > 128 else ("error",)  # a signal's line says so, 128 + signum
    errors = [line for line in err.splitlines() if line.startswith("mcore-rl") and failed[0] in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for needle in case.needles:
        assert needle in errors[0], (needle, errors[0])
    assert snapshot(ws.root) == before, "a file was changed, added or removed"
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, workspace: Workspace, capsys, monkeypatch):
    _run_case(case, workspace, capsys, monkeypatch)
    assert not os.path.exists(workspace.p("ran")), "a checkpoint's pickle ran code"
    assert not os.path.exists(workspace.p("cwd", "ran")), "a checkpoint's pickle ran code"


def test_the_table_is_wide():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)
