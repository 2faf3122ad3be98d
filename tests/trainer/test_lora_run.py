"""A LoRA GRPO run (CPU, fp32, in-process) from an HF folder: the rollout gets the merged weights
(``token_mult_prob_error`` 1), the reference is the base (KL 0 at step 1, then > 0), run checkpoints hold the
adapters alone and resume exactly, and the run ends with ``lora_adapter/`` (PEFT: transformers + peft give
our logits) beside the merged ``model/``; a resume with other adapters, or none, is refused naming the file."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from mcore_rl.engine.lora import gather_adapter_state, rollout_parameters
from mcore_rl.engine.train_engine import MicroBatch
from mcore_rl.engine.weights import gather_full_state
from mcore_rl.io.errors import ConfigError, InputError
from mcore_rl.trainer.trainer import Trainer
from tests.convert.hf_models import hf_logits, save_hf_model
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "model.lora_rank=4",
    "model.lora_alpha=8",
    "algorithm.use_kl_loss=true",
    "algorithm.kl_loss_coef=0.1",
    "optim.lr=1e-2",
    "trainer.total_training_steps=3",
    "trainer.save_freq=2",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
]
TIMING = ("time/", "tokens_per_s", "memory/")
TOKENS = torch.tensor([[3, 5, 7, 9, 11, 4, 6, 8], [2, 4, 6, 8, 10, 12, 13, 1]])


def _config(tmp_path, run: str, *extra: str):
    hf = str(tmp_path / "hf")
    if not os.path.isdir(hf):
        save_hf_model(hf, "llama", vocab_size=14, max_position_embeddings=32)
    folder = f"trainer.default_local_dir={tmp_path / run}"
    cfg = tiny_run_config(str(tmp_path / "data"), [*OVERRIDES, f"model.path={hf}", folder, *extra])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_config={}))  # the folder's config


def _logits(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    return output.sum() * 0.0, {"logits": output.detach()[..., :14]}


def _ours(trainer: Trainer) -> dict:
    worker = trainer.actors.backend.worker  # type: ignore[attr-defined]
    engine = worker.engine
    batch = MicroBatch(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))
    return {
        "logits": engine.forward_backward([batch], _logits, forward_only=True)[0]["logits"],
        "adapters": gather_adapter_state(engine.chunks, engine.arch, engine.ctx),
        "reference_is_a_view": worker.reference is not None and worker.reference.chunks is engine.chunks,
    }


def _rl(trainer: Trainer, steps: set[int]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in trainer.records
        if r["stage"] == "rl" and r["step"] in steps
    ]


def test_lora_grpo_run_syncs_merged_weights_resumes_exactly_and_exports_peft(tmp_path) -> None:
    import peft
    import transformers

    with Trainer.from_config(_config(tmp_path, "a"), use_ray=False) as straight:
        straight.fit()
        expected, ours = _rl(straight, {3}), _ours(straight)
    steps = _rl(straight, {1, 2, 3})
    assert all(abs(r["token_mult_prob_error"] - 1.0) <= 1e-6 for r in steps)  # rollout == trainer, merged
    assert steps[0]["kl_loss"] == 0.0 and steps[1]["kl_loss"] > 1e-5  # the reference is the base
    assert ours["reference_is_a_view"]

    checkpoint = tmp_path / "a" / "checkpoints" / "global_step_2"
    stored = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [k for k in stored if k.endswith("weight") and not k.startswith("optimizer")]
    assert weights and all(".lora_" in k for k in weights), weights  # adapters only, no base weight

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "a" / "lora_adapter")).eval()
    with torch.no_grad():
        theirs = with_adapter(input_ids=TOKENS).logits
    assert (theirs - ours["logits"]).abs().max() <= 1e-5
    assert (hf_logits(str(tmp_path / "a" / "model"), TOKENS) - ours["logits"]).abs().max() <= 1e-5  # merged

    _convert_on_demand(tmp_path, ours["logits"])
    _import_peft(tmp_path, ours["logits"])

    interrupted = _config(tmp_path, "b")
    with Trainer.from_config(interrupted, use_ray=False) as first:
        first.fit(stop_after=2)
    with Trainer.from_config(interrupted, use_ray=False) as resumed:
        resumed.fit()
        assert _rl(resumed, {3}) == expected
        again = _ours(resumed)
    assert all(torch.equal(again["adapters"][k], v) for k, v in ours["adapters"].items())

    for change, named in (
        ("model.lora_rank=8", "model.lora_rank=4"),
        ("model.lora_rank=0", "saved with LoRA"),
    ):
        with pytest.raises(InputError, match=f"trainer_state.json: .*{named}"):  # before any worker starts
            Trainer.from_config(
                _config(tmp_path, "b", change, "trainer.total_training_steps=4"), use_ray=False
            )


def _convert_on_demand(tmp_path, logits: torch.Tensor) -> None:
    """``mcore-rl convert``: the last run checkpoint as a PEFT folder (the end-of-run adapter's tensors), merged
    into the base from it and from the PEFT folder (transformers gives our logits); the checkpoint is no model."""
    from safetensors.torch import load_file

    from mcore_rl.cli import main
    from mcore_rl.engine.checkpoint import load_model

    run, hf = tmp_path / "a", str(tmp_path / "hf")
    last = str(run / "checkpoints" / "global_step_3")
    assert main(["convert", "mcore-to-hf", "--ckpt", last, "--out", str(tmp_path / "peft")]) == 0
    exported = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    at_end = load_file(str(run / "lora_adapter" / "adapter_model.safetensors"))
    assert exported.keys() == at_end.keys() and all(torch.equal(exported[k], v) for k, v in at_end.items())
    for source, out in ((last, "merged"), (str(run / "lora_adapter"), "merged_from_peft")):
        args = [
            "convert",
            "mcore-to-hf",
            "--ckpt",
            source,
            "--merge-lora",
            "--base",
            hf,
            "--out",
            str(tmp_path / out),
        ]
        assert main(args) == 0
        assert (hf_logits(str(tmp_path / out), TOKENS) - logits).abs().max() <= 1e-5
    with pytest.raises(InputError, match="a LoRA run checkpoint holds the adapters, not the model"):
        load_model([], None, last)  # type: ignore[arg-type]  # model.path=<it> is refused before any read


def _import_peft(tmp_path, logits: torch.Tensor) -> None:
    """``model.lora_adapter_path``: the run's PEFT folder into a new run's adapters (our logits again, and a
    step trains them on); one of another rank is refused naming its config file."""
    adapter = f"model.lora_adapter_path={tmp_path / 'a' / 'lora_adapter'}"
    ppo = ["trainer.save_freq=-1", "algorithm.adv_estimator=gae", "algorithm.use_kl_loss=false"]
    with Trainer.from_config(_config(tmp_path, "c", adapter, *ppo), use_ray=False) as run:
        assert (_ours(run)["logits"] - logits).abs().max() <= 1e-5
        worker = run.actors.backend.worker  # type: ignore[attr-defined]
        engine, critic = worker.engine, worker.critic.engine
        merged = gather_full_state(
            engine.models, engine.arch, engine.ctx, rollout_parameters(engine.models, engine.arch, engine.ctx)
        )
        body = gather_full_state(critic.models, critic.arch, critic.ctx)
        assert all(
            torch.equal(body[k], v) for k, v in merged.items() if k.startswith("decoder.")
        )  # critic: merged
        imported = _ours(run)["adapters"]
        run.fit(stop_after=1)
        trained = _ours(run)["adapters"]
        assert any(not torch.equal(trained[k], v) for k, v in imported.items())  # a step trains them on
    # the reference of a LoRA run is its base, adapters off: not the imported adapter RL starts from
    with pytest.raises(ConfigError, match=r"model\.lora_adapter_path=.* with algorithm\.use_kl_loss=true"):
        Trainer.from_config(_config(tmp_path, "e", adapter, "algorithm.use_kl_loss=true"), use_ray=False)
    refused = r"model\.lora_adapter_path: .*adapter_config\.json: r=4, the run's model section says 8"
    with pytest.raises(ConfigError, match=refused):  # before any worker starts
        Trainer.from_config(_config(tmp_path, "d", adapter, *ppo, "model.lora_rank=8"), use_ray=False)


def test_lora_dropout_resumes_exactly(tmp_path) -> None:
    """Dropout masks come from (seed, optimizer step), which the checkpoint restores: the resumed step 3 is
    the uninterrupted one (the RNG restarted from the seed: other masks, pg_loss 0.141 against 0.120)."""
    dropout = "model.lora_dropout=0.3"
    with Trainer.from_config(_config(tmp_path, "a", dropout), use_ray=False) as straight:
        straight.fit()
        expected, adapters = _rl(straight, {3}), _ours(straight)["adapters"]
    interrupted = _config(tmp_path, "b", dropout)
    with Trainer.from_config(interrupted, use_ray=False) as first:
        first.fit(stop_after=2)
    with Trainer.from_config(interrupted, use_ray=False) as resumed:
        resumed.fit()
        assert _rl(resumed, {3}) == expected
        again = _ours(resumed)["adapters"]
    assert all(torch.equal(again[k], v) for k, v in adapters.items())


def test_lora_sft_writes_the_merged_model_and_its_peft_adapter(tmp_path) -> None:
    """SFT with LoRA (``mcore-rl sft``): ``model/`` is the base with the trained adapters merged, and
    transformers + peft on the base with ``lora_adapter/`` give its logits."""
    import peft
    import transformers

    from mcore_rl.trainer.sft import fit_sft, sft_config

    extra = [
        f"sft.train_files=[{tmp_path / 'data' / 'sft.jsonl'}]",
        "sft.total_steps=2",
        "sft.test_freq=100",
        "sft.train_batch_size=8",
        "sft.micro_batch_size_per_gpu=8",
    ]
    cfg = sft_config(_config(tmp_path, "sft", *extra, "data.test_files=[]"))
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        summary = fit_sft(trainer)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=TOKENS).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "sft" / "lora_adapter")).eval()
        theirs = adapted(input_ids=TOKENS).logits
    merged = hf_logits(summary.model_dir, TOKENS)
    assert (theirs - merged).abs().max() <= 1e-5 and (merged - before).abs().max() > 1e-4  # it trained


def test_ppo_with_lora_trains_the_adapters_beside_a_full_critic(tmp_path) -> None:
    """PPO's actor with LoRA (in-process): the critic is a full model started from the actor's weights, the
    actor's rollout gets its merged weights, and only the adapters move."""
    ppo = ["algorithm.adv_estimator=gae", "trainer.total_training_steps=2", "trainer.save_freq=-1"]
    with Trainer.from_config(_config(tmp_path, "ppo", *ppo), use_ray=False) as run:
        before = _ours(run)["adapters"]
        run.fit()
        after = _ours(run)["adapters"]
    steps = _rl(run, {1, 2})
    assert [r["step"] for r in steps] == [1, 2]  # both steps logged: the checks below see each
    assert all(abs(r["token_mult_prob_error"] - 1.0) <= 1e-6 for r in steps)
    assert all("critic/values_mean" in r for r in steps)
    assert any(not torch.equal(after[k], v) for k, v in before.items() if ".lora_B." in k)  # B left zero


def test_lora_on_a_mixture_of_experts_model_adapts_its_attention_end_to_end(tmp_path) -> None:
    """Qwen3-MoE (top-2 of 4 experts, layer 1 dense) with adapters on its attention: the rollout follows the
    merged weights (``token_mult_prob_error`` 1), the run's ``lora_adapter/`` on transformers' Qwen3-MoE
    through peft gives our logits, and so do the merged ``model/`` and ``convert --merge-lora``'s."""
    import peft
    import transformers

    from mcore_rl.cli import main

    save_hf_model(str(tmp_path / "hf"), "qwen3_moe", vocab_size=14, max_position_embeddings=32)
    attention = ["model.target_modules=[q_proj,k_proj,v_proj,o_proj]", "trainer.total_training_steps=2"]
    with Trainer.from_config(
        _config(tmp_path, "moe", *attention, "trainer.save_freq=-1"), use_ray=False
    ) as run:
        run.fit()
        ours = _ours(run)
    steps = _rl(run, {1, 2})
    assert len(steps) == 2 and all(abs(r["token_mult_prob_error"] - 1.0) <= 1e-6 for r in steps)
    assert {k.split(".lora_")[1].split(".")[1] for k in ours["adapters"]} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "moe" / "lora_adapter")).eval()
    with torch.no_grad():
        theirs = with_adapter(input_ids=TOKENS).logits
        with with_adapter.disable_adapter():
            plain = with_adapter(input_ids=TOKENS).logits
    assert (theirs - ours["logits"]).abs().max() <= 1e-5
    assert (theirs - plain).abs().max() > 1e-4  # the adapters trained: not the base's logits
    assert (hf_logits(str(tmp_path / "moe" / "model"), TOKENS) - ours["logits"]).abs().max() <= 1e-5  # merged
    adapter, merged = str(tmp_path / "moe" / "lora_adapter"), str(tmp_path / "merged")
    args = ["convert", "mcore-to-hf", "--ckpt", adapter, "--merge-lora", "--base", str(tmp_path / "hf")]
    assert main([*args, "--out", merged]) == 0  # the experts pass through, the attention merged
    assert (hf_logits(merged, TOKENS) - ours["logits"]).abs().max() <= 1e-5
