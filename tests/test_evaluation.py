"""Held-out evaluation per agent: hand-checked metrics, a collapsed policy flagged, and the train job
evaluating versions 0, every and last on real engines (greedy, reproducible by recomputation); the same launch's
step metrics as TensorBoard and MLflow receive them (``tracking``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.run.events import EvaluationCommitted, StepFinished
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
    lacks = r"'code_writer_tester' lacks what this config needs: evaluation_cases \(evaluation\.every\)"
    with pytest.raises(ConfigError, match=lacks):
        parse_config(data)


@pytest.fixture(scope="module")
def evaluated(local_ray, demo_config_data: dict, tmp_path_factory) -> tuple:
    """A 3-step launch evaluating every 2 versions, its metrics sent to TensorBoard and MLflow; its events."""
    work = tmp_path_factory.mktemp("evaluated")
    data = small_config_data(demo_config_data, work / "store", steps=3)
    data["evaluation"] = {"every": 2, "cases_per_agent": 16}
    data["tracking"] = {"tensorboard": str(work / "tensorboard"), "mlflow": f"sqlite:///{work / 'mlflow.db'}"}
    config = parse_config(data)
    return config, list(train(config))


def test_train_job_evaluates_every_agent_and_a_recomputation_agrees(evaluated) -> None:
    config, events = evaluated
    events = [event for event in events if isinstance(event, EvaluationCommitted)]
    assert sorted(event.version for event in events) == [0, 2, 3]  # 0, every 2, and the launch's last
    store = ExperienceStore(config.store)
    for event in events:
        table = store.read("evaluations", MicroBatchKey(config.run, event.version, 0))
        assert set(table.column("policy_version").to_pylist()) == {event.version}
        assert sorted(event.metrics) == ["solver", "verifier"]
        assert 0.0 <= event.metrics["solver"]["accuracy"] <= 1.0
        assert 0.0 <= event.metrics["verifier"]["balanced_accuracy"] <= 1.0
        assert event.metrics == evaluation_metrics(_environment_of(config), table) == stored_metrics(table)
    # Greedy decoding: evaluating the stored version again from the store gives the same answers.
    stored = store.read("evaluations", MicroBatchKey(config.run, 2, 0)).sort_by([("agent", "ascending"),
                                                                                ("case", "ascending")])
    _, again, _ = recompute_stage("evaluations", config, store, MicroBatchKey(config.run, 2, 0))
    again = again.sort_by([("agent", "ascending"), ("case", "ascending")])
    assert again.column("response_text").to_pylist() == stored.column("response_text").to_pylist()


def _environment_of(config):  # the run's own environment, as the train job builds it
    from marl_pipeline.environment import build_environment

    return build_environment(config.environment.name, config.environment.options)


def _stored_evaluation(store: ExperienceStore, run: str, version: int, verifier_answers) -> None:
    """An evaluations partition as the train job commits it, answers given by hand (a real engine cannot be made
    to collapse on demand): a perfect solver, and a verifier answering ``verifier_answers(case)``."""
    import json

    import pyarrow as pa

    from marl_pipeline.stages.evaluation import with_metrics
    from marl_pipeline.store.schema import EVALUATIONS, with_agent

    rows = []
    for role in ("solver", "verifier"):
        for index, case in enumerate(evaluation_cases(ENV, role, SETTINGS)):
            response = case.label if role == "solver" else verifier_answers(case)
            rows.append({"policy_version": version, "case": index, "task_id": case.task["id"],
                         "task": json.dumps(case.task), "label": case.label, "prompt_text": "",
                         "transcript": json.dumps([{"role": t.role, "text": t.text, "observation": None}
                                                   for t in case.transcript]),
                         "response_text": response, "answer": response, "metrics": None, "status": "ok",
                         "error": None, "agent": role})
    table, _ = with_metrics(ENV, pa.Table.from_pylist(rows, schema=with_agent(EVALUATIONS)))
    store.commit("evaluations", MicroBatchKey(run, version, 0), table)


def test_the_collapse_check_flags_an_agent_that_always_gives_one_answer(tmp_path: Path,
                                                                        demo_config_data: dict) -> None:
    import dagster as dg
    import yaml

    from assets.evaluations import evaluations, no_collapsed_agent
    from assets.partitions import STEPS, step_key
    from marl_pipeline.run.evaluations import evaluation_history
    from resources import ExperienceStoreResource, ExperimentResource, RayCluster

    store = ExperienceStore(tmp_path / "store")
    _stored_evaluation(store, "demo", 0, lambda case: case.label)  # a verifier that tells right from wrong
    _stored_evaluation(store, "demo", 5, lambda case: "yes")  # ... that has collapsed onto "yes"
    history = evaluation_history(store, "demo")
    assert history[0]["verifier"]["balanced_accuracy"] == 1.0 and history[5]["verifier"]["balanced_accuracy"] == 0.5
    assert history[5]["solver"]["accuracy"] == 1.0  # the solver's skill is its own
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store")}))
    experiment = ExperimentResource(config_path=str(config_path))
    resources = {"experiment": experiment, "store": ExperienceStoreResource(experiment=experiment),
                 "ray": RayCluster(experiment=experiment)}
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(STEPS.name, [step_key("demo", 0), step_key("demo", 5)])
    verdicts = {}
    for version in (0, 5):
        only_the_check = dg.AssetSelection.checks(no_collapsed_agent)
        result = dg.materialize([evaluations, no_collapsed_agent], selection=only_the_check, instance=instance,
                                resources=resources,
                                tags={"dagster/partition": step_key("demo", version)})
        assert result.success and not result.get_asset_materialization_events()
        (evaluation,) = result.get_asset_check_evaluations()
        verdicts[version] = (evaluation.passed, evaluation.description)
    assert verdicts[0][0] and not verdicts[5][0]
    assert "verifier gives one answer to 100% of its held-out cases" in verdicts[5][1]
    assert "solver" not in verdicts[5][1]


def test_step_metrics_reach_tensorboard_and_mlflow(evaluated) -> None:
    """Every step's rewards, health signals (as the store's ``health`` partition holds them) and times, and every
    evaluation, as the launch reported them; the share of GRPO groups without reward variance as the store's
    rewards give it."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, events = evaluated
    board = EventAccumulator(str(Path(config.tracking.tensorboard) / config.run), size_guidance={"scalars": 0})
    board.Reload()
    scalars = {tag: {event.step: event.value for event in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
    client = MlflowClient(config.tracking.mlflow)
    [run] = client.search_runs([client.get_experiment_by_name(config.tracking.mlflow_experiment).experiment_id],
                               filter_string=f"tags.`marl.run` = '{config.run}'")
    assert run.info.status == "FINISHED" and run.data.params["agents.solver.trainer.lr"] == str(
        config.agents["solver"].trainer.lr)
    expected = {}
    for event in events:
        if isinstance(event, StepFinished):
            stored = ExperienceStore(config.store).read("health", MicroBatchKey(config.run, event.step, 0))
            assert {row["agent"]: {name: row[name] for name in event.health[row["agent"]]}
                    for row in stored.to_pylist()} == event.health
            expected |= {(f"{agent}/{name}", event.step): value for agent, signals in event.health.items()
                         for name, value in signals.items() if value is not None}
            expected |= {(f"{agent}/reward", event.step): value for agent, value in event.mean_reward.items()}
            expected[("time/step_seconds", event.step)] = event.seconds
        elif isinstance(event, EvaluationCommitted):
            expected |= {(f"{agent}/eval/{name}", event.version): value
                         for agent, metrics in event.metrics.items() for name, value in metrics.items()}
    rewards = ExperienceStore(config.store).read_stage(config.run, "rewards",
                                                       columns=["step", "agent", "group_id", "reward"])
    spread = rewards.group_by(["step", "agent", "group_id"]).aggregate([("reward", "min"), ("reward", "max")])
    for step in range(3):
        for agent in ("solver", "verifier"):
            mine = spread.filter((pc.field("step") == step) & (pc.field("agent") == agent))
            flat = pc.equal(mine.column("reward_min"), mine.column("reward_max"))
            share = pc.sum(flat).as_py() / len(mine)
            assert expected[(f"{agent}/zero_variance_groups", step)] == pytest.approx(share, rel=1e-6)
    assert sorted(step for name, step in expected if name == "solver/reward") == [0, 1, 2]
    assert sorted(step for name, step in expected if name == "verifier/eval/balanced_accuracy") == [0, 2, 3]
    history = {}
    for (name, step), value in expected.items():
        assert scalars[name][step] == pytest.approx(value, rel=1e-6), (name, step)
        history.setdefault(name, {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)})
        assert history[name][step] == pytest.approx(value, rel=1e-12), (name, step)
    assert {"solver/top_response_share", "verifier/clip_fraction", "solver/grad_norm"} <= scalars.keys()
