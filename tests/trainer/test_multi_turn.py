"""Multi-turn rollouts through the driver (in-process rank): the steps train on the model's tokens only (the
log-prob agreement reads 1 on them, while the tool and environment tokens carry no rollout log-prob), GRPO and
PPO, validation and the held-out test run multi-turn, the metrics and a sample conversation reach the run log,
and packed rows, shared prompts and a token budget equal the padded path within 1e-5."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from omegaconf import OmegaConf

from mcore_rl.config import RunConfig, check_config, schema_node
from mcore_rl.data.tool_task import write_tool_dataset
from tests.models import tiny_hf_config
from tests.trainer.common import QUIET

ENV = "rollout.multi_turn.environment=tests.agent.user_tools:CountdownEnv"


def tool_run_config(folder: str, overrides: list[str]) -> RunConfig:
    """4 prompts x 4 conversations per step of the tool demo's task, on a tiny Llama with its ChatML tokenizer;
    the CountdownEnv keeps every conversation going for three model turns whatever the untrained model says
    (its turns kept short by stop ids)."""
    paths = {s: os.path.join(folder, f"{s}.jsonl") for s in ("train", "val", "test", "sft")}
    if not os.path.exists(paths["train"]):
        sizes = {"train": 32, "val": 8, "test": 8, "sft": 32}
        write_tool_dataset({**paths, "tokenizer": os.path.join(folder, "tokenizer")}, seed=1, sizes=sizes)
    hf = tiny_hf_config("llama", vocab_size=128, max_position_embeddings=128)
    base = [
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['val']}]",
        f"data.test_files=[{paths['test']}]",
        f"model.tokenizer_path={os.path.join(folder, 'tokenizer')}",
        "data.train_batch_size=4",
        "data.max_prompt_length=16",
        "data.max_response_length=64",
        "rollout.stop_token_ids=[" + ",".join(map(str, range(40, 128, 3))) + "]",  # short turns, untrained
        "rollout.n=4",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[mcore_rl.agent.calculator:calculator]",
        "rollout.multi_turn.num_workers=0",
        "rollout.multi_turn.log_conversation_freq=1",
        "reward.sources={mcore_rl/tool_calc: exact_match}",
        "algorithm.ppo_micro_batch_size_per_gpu=16",
        "algorithm.recompute_old_log_probs=always",
        "optim.lr=1e-3",
        "trainer.num_cpus=2",
        "trainer.n_gpus_per_node=1",  # in-process runs
        "trainer.total_training_steps=2",
        *QUIET,
    ]
    node = OmegaConf.merge(schema_node(), {"model": {"hf_config": hf}})
    return check_config(OmegaConf.merge(node, OmegaConf.from_dotlist(base + overrides)))


def _records(tmp_path, name: str, overrides: list[str]) -> tuple[list[dict], str]:
    from mcore_rl.trainer.trainer import Trainer

    cfg = tool_run_config(
        str(tmp_path / "data"), [*overrides, f"trainer.default_local_dir={tmp_path / name}"]
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        trainer.fit()
        return trainer.records, cfg.logging.log_dir


def test_grpo_steps_on_multi_turn_rollouts_train_on_the_model_tokens(tmp_path) -> None:
    records, log_dir = _records(
        tmp_path, "grpo", [ENV, "trainer.val_before_train=true", "logging.log_val_generations=1"]
    )
    steps = [r for r in records if r["stage"] == "rl" and "reward" in r]
    assert len(steps) == 2
    for m in steps:
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-5  # on the model's tokens, none of the env's
        assert m["multi_turn/turns_mean"] > 1 and m["multi_turn/context_tokens_mean"] > 0
        assert m["multi_turn/tool_reward_mean"] > 0  # the environment's rewards reach the score
        assert m["reward"] >= m["multi_turn/tool_reward_mean"] and m["num_optimizer_steps"] == 1
    assert [r["when"] for r in records if r["stage"] == "test"] == ["before", "after_rl"]
    with open(os.path.join(log_dir, "generations.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    conversations = [s for s in samples if s["stage"] == "rl" and s["step"] > 0]
    assert [s["step"] for s in conversations] == [1, 2]  # log_conversation_freq=1
    messages = conversations[0]["conversation"]["messages"]
    assert [m["role"] for m in messages[:4]] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"].startswith("go on ")
    with open(tmp_path / "data" / "train.jsonl") as f:
        row_prompts = [json.loads(line)["prompt"] for line in f]
    assert messages[:1] in row_prompts  # the row's own messages, carried from the data to the agent loop
    assert any(s["stage"] == "test" and "conversation" in s for s in samples)  # the held-out test, multi-turn


def test_ppo_on_multi_turn_rollouts(tmp_path) -> None:
    records, _ = _records(tmp_path, "ppo", [ENV, "algorithm.adv_estimator=gae", "critic.warmup_steps=0"])
    steps = [r for r in records if r["stage"] == "rl" and "reward" in r]
    assert len(steps) == 2
    for m in steps:
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-5 and m["multi_turn/turns_mean"] > 1
        assert m["critic/vf_loss"] > 0 and m["num_optimizer_steps"] == 1


def test_packing_shared_prompts_and_a_token_budget_equal_the_padded_path(tmp_path) -> None:
    base = [ENV, "algorithm.ppo_micro_batch_size_per_gpu=4"]
    padded, _ = _records(tmp_path, "padded", base)
    packed, _ = _records(
        tmp_path,
        "packed",
        [*base, "model.use_remove_padding=true", "algorithm.ppo_max_token_len_per_gpu=200"],
    )
    shared, _ = _records(tmp_path, "shared", [*base, "model.share_prompt_prefix=true"])
    keys = (
        "reward",
        "pg_loss",
        "entropy",
        "grad_norm",
        "token_mult_prob_error",
        "multi_turn/context_tokens_mean",
    )
    compared = 0
    for want, *others in zip(padded, packed, shared, strict=True):
        if want["stage"] != "rl" or "reward" not in want:
            continue
        compared += 1
        for have in others:
            for key in keys:
                assert have[key] == pytest.approx(want[key], abs=1e-5), key
    assert compared == 2


def test_one_step_off_trains_on_conversations_sampled_ahead_and_resumes_exactly(tmp_path) -> None:
    """``trainer.one_step_off``: from step 2 each step trains on the conversations sampled before the last
    update (policy lag 1, importance-weighted), scored with their own tool and environment rewards while the
    next step's are sampled; a checkpoint keeps them beside the pending rollout (``pending_turns.json``) and
    the resumed run's step 3 equals the uninterrupted one's."""
    from mcore_rl.trainer.run_checkpoint import load_pending
    from mcore_rl.trainer.trainer import Trainer

    timing = ("time/", "tokens_per_s", "memory/")
    extra = [ENV, "trainer.one_step_off=true", "trainer.total_training_steps=3", "trainer.save_freq=2"]
    records, _ = _records(tmp_path, "straight", extra)
    steps = [r for r in records if r["stage"] == "rl" and "reward" in r]
    assert [r["policy_lag"] for r in steps] == [0.0, 1.0, 1.0] and "rollout_is/mean" in steps[1]
    for m in steps:  # each step's own conversations: their metrics and rewards, not the ones sampled ahead
        assert m["multi_turn/turns_mean"] > 1 and m["multi_turn/tool_reward_mean"] > 0
        assert m["reward"] >= m["multi_turn/tool_reward_mean"]
    expected = [{k: v for k, v in r.items() if not k.startswith(timing)} for r in steps if r["step"] == 3]

    cfg = tool_run_config(
        str(tmp_path / "data"), [*extra, f"trainer.default_local_dir={tmp_path / 'resumed'}"]
    )
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=2)
    saved = os.path.join(first.checkpoint_root, "global_step_2")
    assert {"pending_rollout.safetensors", "pending_turns.json"} <= set(os.listdir(saved))
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        resumed.fit()
        got = [
            {k: v for k, v in r.items() if not k.startswith(timing)}
            for r in resumed.records
            if r["stage"] == "rl" and "reward" in r and r["step"] == 3
        ]
    assert got == expected

    rollout, turns = load_pending(saved, multi_turn=True)
    assert turns is not None and turns.batch is rollout and len(turns.conversations) == 16
    os.remove(
        os.path.join(saved, "pending_turns.json")
    )  # a pending rollout without them is refused, naming it
    with pytest.raises(ValueError, match=r"has no pending_turns\.json \(its conversations\)"):
        load_pending(saved, multi_turn=True)


def test_a_template_that_cannot_append_tool_turns_is_refused_before_any_rank_starts(
    tmp_path, monkeypatch
) -> None:
    """The start check (a run's, and ``mcore-rl eval``'s) probes a tool turn: a Qwen3-like template, which
    renders the last assistant turn differently, is refused in one line instead of at the first tool call."""
    import types

    from mcore_rl.agent.config import MultiTurnConfig
    from mcore_rl.data.tokenizer import TokenizerError, load_tokenizer
    from mcore_rl.trainer import build
    from mcore_rl.trainer.evaluate import evaluate_model
    from mcore_rl.trainer.multi_turn import check_multi_turn
    from tests.agent.common import write_qwen3_like_tokenizer

    assets = tmp_path / "ckpt" / "hf_assets"
    write_qwen3_like_tokenizer(str(assets))
    mt = MultiTurnConfig(enable=True, tools=["mcore_rl.agent.calculator:calculator"])
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(multi_turn=mt))
    refused = "renders an assistant turn differently when a tool turn follows it"
    with pytest.raises(TokenizerError, match=refused):
        check_multi_turn(cfg, load_tokenizer(str(assets)))  # type: ignore[arg-type]
    (tmp_path / "ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    hf = tiny_hf_config("llama", vocab_size=128, max_position_embeddings=1024)
    info = {"hf_config": hf, "dtype": "float32", "format_version": 1, "extra": {}}
    (tmp_path / "ckpt" / "mcore_rl_model.json").write_text(json.dumps(info))
    (tmp_path / "x.jsonl").write_text("")
    monkeypatch.setattr(build, "build_actor_group", lambda *a, **k: pytest.fail("the ranks started"))
    overrides = [
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[mcore_rl.agent.calculator:calculator]",
    ]
    with pytest.raises(TokenizerError, match=refused):
        evaluate_model(str(tmp_path / "ckpt"), [str(tmp_path / "x.jsonl")], overrides, use_ray=False)


def test_the_tool_demo_recipe_runs_end_to_end(tmp_path, capsys) -> None:
    """``mcore-rl train recipes/tool_demo_cpu.yaml`` shrunk: SFT on its tool traces, RL steps whose calculator
    calls run in a sandboxed worker process, multi_turn/* in metrics.jsonl and TensorBoard, a conversation
    logged every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mcore_rl.cli import main

    data, run = tmp_path / "data", str(tmp_path / "run")
    tool_run_config(str(data), [])  # writes the small splits and the tokenizer
    overrides = [
        "data.generate=null",
        *(f"data.{s}_files=[{data}/{s}.jsonl]" for s in ("train", "val", "test")),
        f"sft.train_files=[{data}/sft.jsonl]",
        f"model.tokenizer_path={data}/tokenizer",
        "model.hf_config.hidden_size=64",
        "data.train_batch_size=4",
        "rollout.n=4",
        "algorithm.ppo_micro_batch_size_per_gpu=16",
        "sft.total_steps=3",
        "sft.test_freq=3",
        "sft.train_batch_size=16",
        "sft.micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "rollout.multi_turn.log_conversation_freq=1",
        "logging.tensorboard=true",
        "logging.progress_bar=false",
        "logging.plot=false",
        f"trainer.default_local_dir={run}",
    ]
    assert main(["train", "recipes/tool_demo_cpu.yaml", *overrides, "--in-process"]) == 0
    assert "after 2 RL steps" in capsys.readouterr().out
    with open(os.path.join(run, "logs", "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["stage"] == "rl" and "reward" in r]
    assert len(rl) == 2 and all("multi_turn/tool_calls_mean" in r for r in rl)
    events = EventAccumulator(os.path.join(run, "logs", "tensorboard")).Reload()
    assert {"rl/multi_turn/turns_mean", "rl/multi_turn/bad_calls"} <= set(events.Tags()["scalars"])
    with open(os.path.join(run, "logs", "generations.jsonl")) as f:
        steps = [s["step"] for s in map(json.loads, f) if s["stage"] == "rl" and "conversation" in s]
    assert steps == [1, 2]


def test_turns_stay_on_their_replica_and_come_back_in_request_order() -> None:
    import torch

    from mcore_rl.engine.rollout.base import GenerationOutput
    from mcore_rl.trainer.multi_turn import _joined, route_turns

    # 10 conversations over 3 replicas: rows 0-3, 4-6, 7-9 (r * 3 // 10); this turn's open ones in any order
    open_rows = [9, 0, 5, 3, 7]
    routed = route_turns(open_rows, 10, 3)
    assert routed == [[1, 3], [2], [0, 4]]

    def replica_output(part: list[int]) -> GenerationOutput:  # each row answers its id, then 1 for odd ids
        rows = [open_rows[i] for i in part]
        ids, lengths = torch.tensor([[r, 1] for r in rows]), torch.tensor([1 + r % 2 for r in rows])
        return GenerationOutput(
            torch.arange(len(part)), ids, torch.zeros(len(part), 2), lengths, ["stop"] * len(part)
        )

    outs = [replica_output(part) for part in routed]
    joined = _joined(outs, routed, len(open_rows), pad_id=0)
    assert joined.token_ids[:, 0].tolist() == open_rows and joined.lengths.tolist() == [2, 1, 2, 2, 2]
    assert _joined([None, outs[1], None], [[], [0], []], 1, 0).token_ids.tolist() == [[5, 1]]
    with pytest.raises(ValueError, match="not one of the rollout's 10"):
        route_turns([10], 10, 3)


@pytest.mark.sweep  # Ray: two rollout replicas (DP2), then a rollout pool of its own; ~1 min each
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(
    "placement", [[], ["rollout.colocate=false", "rollout.num_ranks=2"]], ids=["dp2", "pool"]
)
def test_multi_turn_steps_through_ray(tmp_path, placement: list[str]) -> None:
    from mcore_rl.trainer.trainer import Trainer

    cfg = tool_run_config(
        str(tmp_path / "data"),
        [
            ENV,
            "trainer.n_gpus_per_node=2",
            "algorithm.ppo_micro_batch_size_per_gpu=8",
            *placement,
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        records = [r for r in trainer.records if r["stage"] == "rl" and "reward" in r]
    assert len(records) == 2
    for m in records:
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-5 and m["multi_turn/turns_mean"] > 1


@pytest.mark.sweep  # vLLM in the Ray workers (~40 s); tests/engine/rollout/test_vllm_engine.py checks its turns in make test
@pytest.mark.usefixtures("ray_session")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install)")
def test_multi_turn_steps_with_vllm(tmp_path) -> None:
    from mcore_rl.trainer.trainer import Trainer

    vllm = ["rollout.name=vllm", "model.hf_config.hidden_size=128", "rollout.kv_cache_memory_bytes=16777216"]
    cfg = tool_run_config(
        str(tmp_path / "data"), [ENV, *vllm, f"trainer.default_local_dir={tmp_path / 'run'}"]
    )
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        records = [r for r in trainer.records if r["stage"] == "rl" and "reward" in r]
    assert len(records) == 2
    for m in records:
        assert 0.999 <= m["token_mult_prob_error"] <= 1.001 and m["multi_turn/turns_mean"] > 1


def test_a_reward_model_beside_multi_turn_keeps_the_tool_and_environment_rewards(tmp_path) -> None:
    """``rule_weight * rules + weight * model`` plus the rewards the tools and the environment returned: the
    reward model does not replace them (they reach the advantages, as without it)."""
    import torch

    from mcore_rl.trainer.trainer import Trainer
    from tests.engine.workers.test_reward_model import _save_classifier

    folder = str(tmp_path / "rm")
    _save_classifier(folder, "llama", vocab=128, positions=128)
    overrides = [
        ENV,
        f"reward_model.path={folder}",
        "reward_model.rule_weight=0.5",
        "reward_model.weight=2",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    cfg = tool_run_config(str(tmp_path / "data"), overrides)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        step = trainer._step
        training_scores = step.training_scores

        def checked(rollout, prompts):  # passes the step's own scores through
            scored = training_scores(rollout, prompts)
            turns = step.turns_of(rollout)
            assert turns is not None and scored.model_scores is not None
            expected = 0.5 * scored.rule_scores + 2.0 * scored.model_scores + turns.tool_rewards
            seen.append((scored.scores.clone(), expected))
            assert float(turns.tool_rewards.abs().sum()) > 0  # the environment rewarded something
            return scored

        step.training_scores = checked
        trainer.fit()
    assert len(seen) == 1 and torch.equal(*seen[0])


@pytest.mark.sweep  # Ray, a rollout pool of its own: ~1 min
@pytest.mark.usefixtures("ray_session")
def test_one_step_off_on_a_rollout_pool_reproduces_the_colocated_run(tmp_path) -> None:
    """``rollout.colocate=false``: the next step's conversations are driven from a thread of the driver on the
    pool while the actor updates, and the pool is sent the new weights only once they have ended; the numbers
    are the colocated in-process run's (same seeds, one replica), so no turn sampled from weights of the wrong
    step."""
    from mcore_rl.trainer.trainer import Trainer

    extra = [ENV, "trainer.one_step_off=true", "trainer.total_training_steps=3"]
    colocated, _ = _records(tmp_path, "colocated", extra)
    cfg = tool_run_config(
        str(tmp_path / "data"),
        [*extra, "rollout.colocate=false", f"trainer.default_local_dir={tmp_path / 'pool'}"],
    )
    with Trainer.from_config(cfg, use_ray=True) as trainer:
        trainer.fit()
        pool = [r for r in trainer.records if r["stage"] == "rl" and "reward" in r]
    want = [r for r in colocated if r["stage"] == "rl" and "reward" in r]
    assert [r["policy_lag"] for r in pool] == [0.0, 1.0, 1.0] and "time/generate_wait_s" in pool[1]
    keys = ("reward", "pg_loss", "entropy", "grad_norm", "token_mult_prob_error", "rollout_is/mean")
    for expected, have in zip(want, pool, strict=True):
        assert have["multi_turn/turns_mean"] == expected["multi_turn/turns_mean"]
        for key in keys:
            if key in expected:
                assert have[key] == pytest.approx(expected[key], abs=1e-5), key


def test_dynamic_sampling_keeps_the_conversations_of_the_groups_it_keeps(tmp_path) -> None:
    """``algorithm.filter_groups`` on multi-turn rollouts: every step trains on groups with mixed rewards, and
    its multi-turn metrics and logged conversation are those of the kept conversations (their tool rewards in
    the reward), joined from the rollouts it sampled."""
    records, _ = _records(tmp_path, "filtered", [ENV, "algorithm.filter_groups.enable=true"])
    steps = [r for r in records if r["stage"] == "rl" and "reward" in r]
    assert len(steps) == 2
    for m in steps:
        assert m["mixed_groups"] == 1.0 and m["filter_groups/num_gen_batches"] >= 1
        assert m["multi_turn/turns_mean"] > 1 and m["multi_turn/tool_reward_mean"] > 0
        assert abs(m["token_mult_prob_error"] - 1.0) < 1e-5  # the joined rows' log-probs where they belong
    assert max(m["filter_groups/num_gen_batches"] for m in steps) >= 2  # kept groups joined from rollouts
