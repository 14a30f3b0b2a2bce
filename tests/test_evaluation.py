"""Held-out evaluation per agent: hand-checked metrics, a collapsed policy flagged, and the train job
evaluating versions 0, every and last on real engines (greedy, reproducible by recomputation)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.run.events import EvaluationCommitted
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.evaluation import (
    EvaluationSettings,
    answer_statistics,
    evaluation_cases,
    evaluation_metrics,
    stored_metrics,
)
from marl_pipeline.stages.recompute import recompute_stage
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.conftest import small_config_data

ENV = ArithmeticCheck(ArithmeticOptions(max_operand=9))
SETTINGS = EvaluationSettings(seed=0, cases_per_agent=40, max_new_tokens=4)


def test_answer_statistics_by_hand() -> None:
    stats = answer_statistics(["3", "3", "4", "5"], ["3", "3", "4", "5"])
    assert stats["top_answer_share"] == 0.5
    assert stats["answer_entropy"] == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert stats["collapsed"] == 0.0
    assert answer_statistics(["7"] * 20, ["7"] * 20)["collapsed"] == 0.0  # one right answer: not a collapse


def test_a_verifier_that_always_says_yes_scores_half_and_is_flagged() -> None:
    cases = evaluation_cases(ENV, "verifier", SETTINGS)
    labels = [case.label for case in cases]
    assert labels.count("yes") == labels.count("no") == 20  # wrong answers present, whatever a solver says
    always_yes = ENV.evaluate("verifier", cases, ["yes"] * len(cases))
    assert always_yes == {"balanced_accuracy": 0.5, "true_positive_rate": 1.0, "true_negative_rate": 0.0}
    perfect = ENV.evaluate("verifier", cases, labels)
    assert perfect["balanced_accuracy"] == 1.0
    stats = answer_statistics(["yes"] * len(cases), labels)
    assert stats["collapsed"] == 1.0 and stats["top_answer_share"] == 1.0 and stats["answer_entropy"] == 0.0


def test_solver_accuracy_and_the_held_out_stream() -> None:
    cases = evaluation_cases(ENV, "solver", SETTINGS)
    assert cases == evaluation_cases(ENV, "solver", SETTINGS)  # the same cases for every version
    answers = [case.label if i % 4 else "x" for i, case in enumerate(cases)]  # every 4th one wrong
    assert ENV.evaluate("solver", cases, answers) == {"accuracy": 0.75}
    # The stream is not a training stream: training draws tasks from [seed, step, micro_batch].
    training = ENV.sample_tasks(np.random.default_rng([0, 0, 0]), 40)
    assert [c.task for c in cases] != training


def test_evaluation_needs_a_plugin_that_evaluates(demo_config_data: dict, tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store")
    data["environment"] = {"name": "code_writer_tester", "options": {}}
    data["agents"] = {"writer": {}, "tester": {}}
    data["evaluation"] = {"every": 1}
    with pytest.raises(ConfigError, match=r"evaluation\.every: environment 'code_writer_tester' has no evaluation"):
        parse_config(data)


def test_train_job_evaluates_every_agent_and_a_recomputation_agrees(local_ray, demo_config_data: dict,
                                                                    tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store", steps=3)
    data["evaluation"] = {"every": 2, "cases_per_agent": 16}
    config = parse_config(data)
    events = [event for event in train(config) if isinstance(event, EvaluationCommitted)]
    assert sorted(event.version for event in events) == [0, 2, 3]  # 0, every 2, and the launch's last
    store = ExperienceStore(config.store)
    for event in events:
        table = store.read("evaluations", MicroBatchKey(config.run, event.version, 0))
        assert set(table.column("policy_version").to_pylist()) == {event.version}
        assert sorted(event.metrics) == ["solver", "verifier"]
        assert 0.0 <= event.metrics["solver"]["accuracy"] <= 1.0
        assert 0.0 <= event.metrics["verifier"]["balanced_accuracy"] <= 1.0
        assert event.metrics == evaluation_metrics(ENV_OF(config), table) == stored_metrics(table)
    # Greedy decoding: evaluating the stored version again from the store gives the same answers.
    stored = store.read("evaluations", MicroBatchKey(config.run, 2, 0)).sort_by([("agent", "ascending"),
                                                                                ("case", "ascending")])
    _, again, _ = recompute_stage("evaluations", config, store, MicroBatchKey(config.run, 2, 0))
    again = again.sort_by([("agent", "ascending"), ("case", "ascending")])
    assert again.column("response_text").to_pylist() == stored.column("response_text").to_pylist()


def ENV_OF(config):  # the run's own environment, as the train job builds it
    from marl_pipeline.environment import build_environment

    return build_environment(config.environment.name, config.environment.options)
