"""Held-out evaluation per agent: hand-checked metrics, a collapsed policy flagged, and the train job
evaluating versions 0, every and last on real engines (greedy, reproducible by recomputation); the same launch's
step metrics as TensorBoard and MLflow receive them (``tracking``)."""

from __future__ import annotations

import json
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

SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)

ENV = ArithmeticCheck(ArithmeticOptions(max_operand=9))
SETTINGS = EvaluationSettings(seed=0, cases_per_agent=40, max_new_tokens={"solver": 4, "verifier": 4})


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
    """A 3-step launch evaluating every 2 versions, its metrics sent to TensorBoard, MLflow and wandb (offline);
    its events."""
    work = tmp_path_factory.mktemp("evaluated")
    data = small_config_data(demo_config_data, work / "store", steps=3)
    data["evaluation"] = {"every": 2, "cases_per_agent": 16}
    data["tracking"] = {"tensorboard": str(work / "tensorboard"), "mlflow": f"sqlite:///{work / 'mlflow.db'}",
                        "wandb": {"dir": str(work / "wandb"), "project": "marl-tests", "tags": ["suite"]}}
    config = parse_config(data)
    return config, list(train(config))


@pytest.mark.launch
def test_train_job_evaluates_every_agent_and_a_recomputation_agrees(evaluated) -> None:
    config, events = evaluated
    events = [event for event in events if isinstance(event, EvaluationCommitted)]
    assert sorted(event.version for event in events) == [0, 2, 3]  # 0, every 2, and the launch's last
    store = ExperienceStore(config.store)
    for event in events:
        table = store.read("evaluations", MicroBatchKey(config.run, event.version, 0))
        assert set(table.column("policy_version").to_pylist()) == {event.version}
        assert sorted(event.metrics) == ["solver", "team", "verifier"]
        assert 0.0 <= event.metrics["solver"]["accuracy"] <= 1.0
        assert 0.0 <= event.metrics["verifier"]["balanced_accuracy"] <= 1.0
        assert event.metrics == evaluation_metrics(_environment_of(config), table) == stored_metrics(table)
    # Greedy decoding: evaluating the stored version again from the store gives the same answers.
    stored = store.read("evaluations", MicroBatchKey(config.run, 2, 0)).sort_by([("agent", "ascending"),
                                                                                ("case", "ascending")])
    _, again, _ = recompute_stage("evaluations", config, store, MicroBatchKey(config.run, 2, 0))
    again = again.sort_by([("agent", "ascending"), ("case", "ascending")])
    assert again.column("response_text").to_pylist() == stored.column("response_text").to_pylist()


def test_an_exported_version_carries_its_held_out_evaluation_and_provenance(evaluated, tmp_path: Path) -> None:
    """Version 2, evaluated, exported from the store: its card and provenance.json hold the evaluation and every
    other field as stored (a launch without a Dagster run: its id is None)."""
    from marl_pipeline.run.cards import export_release
    from tests.test_policy_cards import assert_release_matches_store

    config, _ = evaluated
    store = ExperienceStore(config.store)
    export_release(store, config.run, "solver", 2, tmp_path / "solver")
    provenance = assert_release_matches_store(tmp_path / "solver", store, config.run, "solver", 2,
                                              config.pipeline.micro_batches_per_step, [None])
    assert "accuracy" in provenance["evaluation"]["metrics"] and provenance["evaluation"]["team"]
    assert provenance["config"]["evaluation"] == config.model_dump(mode="json")["evaluation"]


def test_the_team_plays_whole_episodes_on_the_solvers_cases_and_its_figures_follow_from_them(evaluated) -> None:
    """The team's rows: each of the solver's held-out cases played n times (solver, then the verifier judging that
    answer, at the version evaluated); the figures recomputed here from the stored episodes by hand."""
    import json

    config, _ = evaluated
    store, n = ExperienceStore(config.store), config.pipeline.samples_per_prompt
    table = store.read("evaluations", MicroBatchKey(config.run, 2, 0))
    team = sorted((row for row in table.to_pylist() if row["agent"] == "team"), key=lambda row: row["case"])
    solver = sorted((row for row in table.to_pylist() if row["agent"] == "solver"), key=lambda row: row["case"])
    assert [row["task"] for row in team] == [row["task"] for row in solver]  # the solver's own held-out cases
    right, first, majority, chosen = [], [], [], []
    for row in team:
        episodes = json.loads(row["transcript"])
        assert len(episodes) == n and all([t["role"] for t in e] == ["solver", "verifier"] for e in episodes)
        task = json.loads(row["task"])
        answers = [e[0]["text"].strip().split("\n")[0].strip() for e in episodes]  # answer_of: the first line
        is_right = [answer.isdigit() and int(answer) == task["a"] + task["b"] for answer in answers]
        accepted = [e[1]["text"].strip().split("\n")[0].strip() == "yes" for e in episodes]
        votes = {a: answers.count(a) for a in answers}
        yes_votes = {a: sum(ok for b, ok in zip(answers, accepted) if b == a) for a in answers}
        pick = next((i for i in range(n) if accepted[i] and yes_votes[answers[i]] == max(yes_votes.values())), 0)
        right.append(any(is_right))
        first.append(is_right[0])
        majority.append(is_right[next(i for i in range(n) if votes[answers[i]] == max(votes.values()))])
        chosen.append(is_right[pick])
        assert row["response_text"] == episodes[pick][0]["text"]
    figures = stored_metrics(table)["team"]
    assert figures["team_answer"] == pytest.approx(np.mean(chosen))
    assert figures["first_sample"] == pytest.approx(np.mean(first))
    assert figures["majority_vote"] == pytest.approx(np.mean(majority))
    assert figures["any_sample"] == pytest.approx(np.mean(right))
    assert max(figures["team_answer"], figures["first_sample"], figures["majority_vote"]) <= figures["any_sample"]


def test_accepted_majority_by_hand() -> None:
    from marl_pipeline.environment import accepted_majority

    assert accepted_majority(["3", "4", "4", "5"], [True, False, False, True]) == 0  # a tie: the first accepted
    assert accepted_majority(["3", "4", "4", "5"], [True, True, True, False]) == 1  # "4" accepted twice
    assert accepted_majority(["3", "4"], [False, False]) == 0  # none accepted: the first sample
    with pytest.raises(ValueError, match="2 answers against 1 verdicts"):
        accepted_majority(["3", "4"], [True])


def test_team_figures_by_hand_and_a_bad_choice_named() -> None:
    """Two cases of 3 + 1 = 4 and 2 + 2 = 4, three episodes each: the verifier picks the right answer where the
    first sample and the majority are wrong, then accepts a wrong one."""
    import json

    from marl_pipeline.stages.evaluation import team_metrics

    def row(case: int, a: int, b: int, episodes: list[tuple[str, str]]) -> dict:
        played = [[{"role": "solver", "text": s, "observation": None},
                   {"role": "verifier", "text": v, "observation": None}] for s, v in episodes]
        return {"task": json.dumps({"id": f"{a}+{b}", "a": a, "b": b}), "label": str(a + b), "case": case,
                "transcript": json.dumps(played), "answer": "-"}

    rows = [row(0, 3, 1, [("5", "no"), ("5", "no"), ("4", "yes")]),
            row(1, 2, 2, [("4", "no"), ("3", "yes"), ("4", "no")])]
    figures = team_metrics(ENV, rows)
    assert figures["team_answer"] == 0.5  # case 0 right (4 accepted), case 1 wrong (3 accepted)
    assert figures["first_sample"] == 0.5  # 5 wrong, 4 right
    assert figures["majority_vote"] == 0.5  # 5 wrong, 4 right
    assert figures["any_sample"] == 1.0

    class Confused(ArithmeticCheck):
        def team_choice(self, task, episodes) -> int:
            return len(episodes)

    with pytest.raises(ValueError, match=r"team_choice returned 3 for task '3\+1': expected the index of one of its 3"):
        team_metrics(Confused(ArithmeticOptions(max_operand=9)), rows)


def test_team_samples_zero_leaves_the_team_out(demo_config_data: dict, tmp_path: Path) -> None:
    from marl_pipeline.stages.team import is_team_evaluated

    data = small_config_data(demo_config_data, tmp_path / "store")
    data["evaluation"] = {"every": 1}
    assert EvaluationSettings.from_config(parse_config(data)).team_samples == data["pipeline"]["samples_per_prompt"]
    assert is_team_evaluated(ENV, EvaluationSettings.from_config(parse_config(data)))
    data["evaluation"]["team_samples"] = 0
    assert not is_team_evaluated(ENV, EvaluationSettings.from_config(parse_config(data)))


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


def wandb_records(path: Path):
    """The records of a wandb run file (``run-<id>.wandb``), read as wandb writes it: a 7-byte header (``:W&B``),
    then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length, kind: 1 whole, 2 first, 3 middle, 4
    last), each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, pending = 7, b""
    while position + 7 <= len(data):
        if (space := 32768 - position % 32768) < 7:  # a block's tail too short for a header is padding
            position += space
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_step_metrics_reach_tensorboard_mlflow_and_wandb(evaluated) -> None:
    """Every step's rewards, health signals (as the store's ``health`` partition holds them) and times, and every
    evaluation, as the launch reported them; the share of GRPO groups without reward variance as the store's
    rewards give it. Wandb's from the files of its offline run, as ``wandb sync`` would upload them."""
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
            # The trainer's throughput under perf/<agent>/ (as verl's perf/mfu/actor), the health signals beside it.
            assert all(signals["trainer_tokens_per_s"] > 0 and 0 < signals["mfu"] < 1
                       for signals in event.health.values())
            perf = {"trainer_tokens_per_s": "perf/{}/tokens_per_s", "mfu": "perf/{}/mfu"}
            expected |= {(perf.get(name, "{}/" + name).format(agent), event.step): value
                         for agent, signals in event.health.items() for name, value in signals.items()
                         if value is not None}
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
    assert sorted(step for name, step in expected if name == "perf/verifier/mfu") == [0, 1, 2]
    assert sorted(step for name, step in expected if name == "verifier/eval/balanced_accuracy") == [0, 2, 3]
    history = {}
    for (name, step), value in expected.items():
        assert scalars[name][step] == pytest.approx(value, rel=1e-6), (name, step)
        history.setdefault(name, {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)})
        assert history[name][step] == pytest.approx(value, rel=1e-12), (name, step)
    assert {"solver/top_response_share", "verifier/clip_fraction", "solver/grad_norm"} <= scalars.keys()

    from marl_pipeline.run.tracking import wandb_run_id

    settings = config.tracking.wandb
    [file] = (Path(settings.dir) / "wandb").glob(f"offline-run-*-{wandb_run_id(config.run)}/run-*.wandb")
    logged, runs, exits = {}, [], []
    for record in wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            assert "step" in row, row
            logged |= {(name, row["step"]): value for name, value in row.items() if not name.startswith("_")}
        runs += [record.run] if kind == "run" else []
        exits += [record.exit.exit_code] if kind == "exit" else []
    [run] = runs
    assert (run.display_name, run.project, exits) == (config.run, "marl-tests", [0])
    assert list(run.tags) == ["arithmetic_check", "solver", "verifier", "suite"]
    for (name, step), value in expected.items():  # every figure at its step, evaluations at their versions'
        assert logged[(name, step)] == pytest.approx(value, rel=1e-12), (name, step)


def test_casts_are_parsed_with_every_role_and_named_errors() -> None:
    from marl_pipeline.run.casts import Cast, parse_cast, standard_casts

    agents = {"solver": "solver", "verifier": "verifier"}
    assert parse_cast("mixed:solver=solver@3,verifier=verifier@0", agents) == Cast(
        "mixed", {"solver": ("solver", 3), "verifier": ("verifier", 0)})
    assert parse_cast("verifier=solver@2,solver=verifier@2", agents).roles == {"solver": ("verifier", 2),
                                                                                "verifier": ("solver", 2)}
    for text, message in (("solver=solver@3", "roles \\['verifier'\\] are not cast"),
                          ("solver=judge@1,verifier=verifier@1", "'judge' is no agent of the run"),
                          ("solver=solver@1,solver=verifier@1,verifier=verifier@1", "role 'solver' is cast twice"),
                          ("solver=solver,verifier=verifier@1", "is not ROLE=AGENT@VERSION")):
        with pytest.raises(ValueError, match=message):
            parse_cast(text, agents)
    assert [(cast.name, cast.roles) for cast in standard_casts(agents, 5)] == [
        ("trained", {"solver": ("solver", 5), "verifier": ("verifier", 5)}),
        ("swapped", {"solver": ("verifier", 5), "verifier": ("solver", 5)}),
        ("solver@0", {"solver": ("solver", 0), "verifier": ("verifier", 5)}),
        ("verifier@0", {"solver": ("solver", 5), "verifier": ("verifier", 0)})]


@pytest.mark.launch
def test_a_cast_plays_the_team_with_any_stored_policy_in_any_role(evaluated) -> None:
    """The trained cast at version 2 is the team's stored evaluation of version 2 again (same cases, seeds and
    policies); the swapped cast and a version-0 cast are played and kept; `marl evaluate` and `marl inspect` show
    them."""
    from typer.testing import CliRunner

    from assets.cli import app
    from marl_pipeline.run.casts import evaluate_cast, parse_cast, stored_casts

    config, _ = evaluated
    store, env = ExperienceStore(config.store), _environment_of(config)
    stored = stored_metrics(store.read("evaluations", MicroBatchKey(config.run, 2, 0)))["team"]
    trained = evaluate_cast(config, env, store, parse_cast("trained:solver=solver@2,verifier=verifier@2",
                                                           config.role_agents()))
    assert trained["metrics"] == stored and trained["cases"] == config.evaluation.cases_per_agent
    result = CliRunner().invoke(app, ["evaluate", str(store.root), "--run", config.run, "--cast",
                                      "swapped:solver=verifier@2,verifier=solver@2", "--cast",
                                      "solver=solver@0,verifier=verifier@3"])
    assert result.exit_code == 0, result.output
    casts = stored_casts(store, config.run)
    assert list(casts) == ["trained", "swapped", "solver=solver@0,verifier=verifier@3"]
    assert casts["swapped"]["roles"] == {"solver": {"agent": "verifier", "version": 2},
                                         "verifier": {"agent": "solver", "version": 2}}
    for entry in casts.values():
        assert 0 <= entry["metrics"]["team_answer"] <= entry["metrics"]["any_sample"] <= 1
    assert casts["swapped"]["metrics"] != stored  # the verifier's policy answering the sums
    assert "the team by cast" in result.output and "swapped" in result.output
    refused = CliRunner().invoke(app, ["evaluate", str(store.root), "--run", config.run, "--cast",
                                       "solver=verifier,verifier=solver@1"])
    assert refused.exit_code == 2 and "ROLE=AGENT@VERSION" in " ".join(refused.output.split())
    inspected = CliRunner().invoke(app, ["inspect", str(store.root), "--run", config.run])
    assert inspected.exit_code == 0 and "the team by cast" in inspected.output
