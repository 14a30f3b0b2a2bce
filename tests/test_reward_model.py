"""Model-based reward: the built-in judge learns the demo's outcome through the agents' trainer, the Ray pool serves
classifiers and causal-LM judges with the bare library's scores and grows and shrinks, the reward stage mixes the
score in, and a training launch stores and replays it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.bootstrap.reward_model import REWARD_MODEL, train_tiny_judge
from marl_pipeline.config import ConfigError, GRPOAdvantage, RewardModelConfig, parse_config
from marl_pipeline.inference.reward_model import RewardModelPool, RewardModelServer
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import ModelReward, score_micro_batch
from tests.conftest import small_config_data
from tests.test_credit_and_actions import rollouts_of

ENV = ArithmeticCheck(ArithmeticOptions())


TEMPLATE = RewardModelConfig().judge_template


@pytest.fixture(scope="module")
def judge_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("rm") / "judge"
    # Fewer steps than the default's 2000, which give 0.99 of the held-out verdicts right on an AVX512 host. Measured
    # there on 2026-12-07, with torch's AVX512 kernels and with ATEN_CPU_CAPABILITY=avx2: 500 steps 0.55 and 0.55,
    # 750 0.92 and 0.92, 1000 0.98 and 0.98; so 1000, with margin past the jump, in half the default's time.
    losses = train_tiny_judge(directory, ENV.reward_examples(np.random.default_rng(1), 4000), steps=1000, seed=0,
                              tokenizer_dir=tiny_model_dir)
    assert np.mean(losses[-20:]) < 0.1 * losses[0]
    return directory


@pytest.fixture(scope="module")
def briefly_taught_judge_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A judge after 20 steps: what mixing its scores into the rewards needs is a real judge, not a good one."""
    directory = tmp_path_factory.mktemp("rm") / "brief"
    train_tiny_judge(directory, ENV.reward_examples(np.random.default_rng(1), 400), steps=20, seed=0,
                     tokenizer_dir=tiny_model_dir)
    return directory


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A sequence classifier of the tiny model's size, untrained: what serving it must equal is the bare library."""
    from transformers import Qwen2ForSequenceClassification

    from marl_pipeline.policy.checkpoint import save_policy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("rm") / "classifier"
    save_policy(Qwen2ForSequenceClassification(config), tokenizer, directory)
    return directory


@pytest.mark.launch
def test_builtin_judge_learns_the_demo_outcome(judge_dir: Path) -> None:
    server = RewardModelServer(str(judge_dir), "judge", judge_template=TEMPLATE)
    held_out = ENV.reward_examples(np.random.default_rng(99), 200)
    scores = server.score([p for p, _, _ in held_out], [r for _, r, _ in held_out])
    accuracy = np.mean([(score > 0.5) == (label > 0.5) for score, (*_, label) in zip(scores, held_out)])
    assert accuracy >= 0.9
    # By hand: 2+3 is 5; the verifier is right to say yes to 5 and no to 4.
    right, wrong, yes_right, yes_wrong, no_wrong = server.score(
        ["2+3=", "2+3=", "2+3=5?", "2+3=4?", "2+3=4?"], ["5", "4", "yes", "yes", "no"])
    assert right > 0.5 > wrong and yes_right > 0.5 > yes_wrong and no_wrong > 0.5


def _bare_classifier(path: Path, prompts: list[str], responses: list[str]) -> list[float]:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        return [torch.sigmoid(model(**tokenizer(p + r, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                .item() for p, r in zip(prompts, responses)]


def _bare_judge(path: Path, template: str, yes: str, no: str, prompts: list[str], responses: list[str]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    yes_id, no_id = (tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in (yes, no))
    scores = []
    with torch.inference_mode():
        for p, r in zip(prompts, responses):
            text = template.format(prompt=p, response=r)
            probs = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, -1].softmax(-1)
            scores.append((probs[yes_id] / (probs[yes_id] + probs[no_id])).item())
    return scores


@pytest.mark.launch
def test_pool_serves_classifier_and_judge_like_the_bare_library(local_ray, classifier_dir: Path,
                                                                  tiny_model_dir: Path) -> None:
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    responses = [str((a + b) if (a * b) % 2 else a + b + 1) for a in range(4) for b in range(4)]
    settings = RewardModelConfig(model=str(classifier_dir), batch_size=4, min_replicas=1, max_replicas=2,
                                 batches_per_replica=1, num_cpus=0)
    pool = RewardModelPool(classifier_dir, settings, idle_grace_s=0.0)
    try:
        assert pool.replicas == 1
        scores = pool.score(prompts, responses)  # 4 batches, 1 per replica wanted: grows to the max of 2
        assert pool.peak_replicas == 2
        assert scores == pytest.approx(_bare_classifier(classifier_dir, prompts, responses), abs=1e-5)
        pool.score(prompts[:2], responses[:2])  # one batch, replicas idle past the grace: back to 1
        assert pool.replicas == 1
    finally:
        pool.shutdown()

    template = "{prompt}{response}?"
    judge = RewardModelConfig(model=str(tiny_model_dir), kind="judge", judge_template=template, judge_yes="yes",
                              judge_no="no", batch_size=8, num_cpus=0)
    pool = RewardModelPool(tiny_model_dir, judge)
    try:
        scores = pool.score(prompts, responses)
        assert scores == pytest.approx(_bare_judge(tiny_model_dir, template, "yes", "no", prompts, responses),
                                       abs=1e-5)
        assert all(0.0 < s < 1.0 for s in scores)
    finally:
        pool.shutdown()


def test_judge_words_must_be_single_tokens(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"reward_model.judge_yes 'absolutely yes' is \d+ tokens"):
        RewardModelServer(str(tiny_model_dir), "judge", judge_template="{prompt}{response}",
                          judge_yes="absolutely yes", judge_no="no")


def test_reward_stage_mixes_the_model_score(briefly_taught_judge_dir: Path) -> None:
    server = RewardModelServer(str(briefly_taught_judge_dir), "judge", judge_template=TEMPLATE)
    task = {"id": "2+3", "a": 2, "b": 3}
    rollouts = rollouts_of(ENV, task, [["5", "yes"], ["4", "yes"], ["x", "no"]])
    rollouts = rollouts.set_column(rollouts.column_names.index("prompt_text"), "prompt_text",
                                   [["2+3=", "2+3=5?", "2+3=", "2+3=4?", "2+3=", "2+3=x?"]])
    results = execute_micro_batch(ENV, rollouts)
    plain = score_micro_batch(ENV, rollouts, results, advantage=GRPOAdvantage(eps=1e-6)).to_pylist()
    weight = 0.25
    mixed = score_micro_batch(ENV, rollouts, results, advantage=GRPOAdvantage(eps=1e-6),
                              model_reward=ModelReward(server.score, frozenset({"solver"}), weight)).to_pylist()
    expected_scores = server.score(["2+3=", "2+3=", "2+3="], ["5", "4", "x"])
    for before, after in zip(plain, mixed):
        if after["role"] == "solver":
            score = expected_scores[after["episode"]]
            assert after["model_score"] == pytest.approx(score, abs=1e-6)
            assert after["reward"] == pytest.approx((1 - weight) * before["reward"] + weight * score, abs=1e-6)
        else:  # not a scored agent: the rule-based reward alone
            assert after["model_score"] is None and after["reward"] == before["reward"]
    assert all(row["model_score"] is None for row in plain)


def test_reward_model_config_errors(demo_config_data: dict, tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store")
    with pytest.raises(ConfigError, match=r"reward_model.agents: unknown agent 'critic'"):
        parse_config({**data, "reward_model": {"agents": ["critic"]}})
    with pytest.raises(ConfigError, match=r"reward_model: .*builtin:tiny is a judge"):
        parse_config({**data, "reward_model": {"kind": "classifier"}})
    with pytest.raises(ConfigError, match=r"reward_model.weight: .*less than or equal to 1"):
        parse_config({**data, "reward_model": {"weight": 2}})
    code = {**data, "environment": {"name": "code_writer_tester"},
            "agents": {"writer": data["agents"]["solver"], "tester": data["agents"]["verifier"]}}
    with pytest.raises(ConfigError, match=r"'code_writer_tester' lacks what this config needs: reward_examples "
                                          r"\(reward_model.model builtin:tiny\)"):
        parse_config({**code, "reward_model": {}})


@pytest.mark.launch
def test_training_launch_stores_and_replays_the_model_reward(local_ray, demo_config_data: dict,
                                                             tmp_path: Path) -> None:
    from marl_pipeline.run.recipe import train
    from marl_pipeline.stages.recompute import recompute_stage
    from marl_pipeline.store import ExperienceStore, MicroBatchKey

    data = small_config_data(demo_config_data, tmp_path / "store", steps=1, micro_batches_per_step=1)
    data["reward_model"] = {"agents": ["solver"], "weight": 0.5, "train_steps": 20, "num_cpus": 0}
    config = parse_config(data)
    list(train(config))
    store = ExperienceStore(config.store)
    key = MicroBatchKey(config.run, 0, 0)
    stored = store.read("rewards", key).sort_by("sample_id").to_pylist()
    solver = [row for row in stored if row["agent"] == "solver"]
    assert solver and all(row["model_score"] is not None for row in solver)
    assert all(row["model_score"] is None for row in stored if row["agent"] == "verifier")
    reward_dir = store.models.fetch(config.run, REWARD_MODEL, 0)  # committed in the store (bootstrap/reward_model.py)
    assert (reward_dir / "config.json").is_file()
    _, replayed, _ = recompute_stage("rewards", config, store, key)
    replayed_rows = replayed.sort_by("sample_id").to_pylist()
    for before, after in zip(stored, replayed_rows, strict=True):
        assert after["sample_id"] == before["sample_id"]
        assert after["reward"] == pytest.approx(before["reward"], abs=1e-5)
        assert (after["model_score"] is None) == (before["model_score"] is None)
    assert json.loads((reward_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]  # a judge
    assert ModelReward.from_settings(config.reward_model, RewardModelServer.from_settings(
        reward_dir, config.reward_model).score).agents == frozenset({"solver"})


def test_reward_stage_refuses_scores_outside_0_1() -> None:
    # A stand-in scorer: a fault (NaN, a short answer) that the real reward model cannot be made to produce.
    task = {"id": "2+3", "a": 2, "b": 3}
    rollouts = rollouts_of(ENV, task, [["5", "yes"], ["4", "yes"]])
    results = execute_micro_batch(ENV, rollouts)
    for scores, message in (([np.float32(0.5), float("nan")], r"outside \[0, 1\]: \[nan\]"),
                            ([0.5], r"returned 1 scores for 2 turns")):
        with pytest.raises(ValueError, match=message):
            score_micro_batch(ENV, rollouts, results, advantage=GRPOAdvantage(eps=1e-6),
                              model_reward=ModelReward(lambda p, r, s=scores: s, frozenset({"solver"})))
