"""The planner on a real stored run: costs fitted from a launch's own timestamps, the launch simulated again, and
``marl plan`` printing a prediction from the store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

from marl_pipeline.config import parse_config
from marl_pipeline.planner.plan import calibration, parse_cluster, predict
from marl_pipeline.run.events import RunFinished, StepFinished
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.launch
def test_a_stored_launch_calibrates_the_simulation_which_replays_it(local_ray, demo_config_data: dict,
                                                                    tmp_path: Path) -> None:
    config = parse_config(small_config_data(demo_config_data, tmp_path / "store", steps=3))
    measured = [event.seconds for event in train(config) if isinstance(event, StepFinished)]
    store = ExperienceStore(config.store)
    nodes = [{"CPU": 2.0, "GPU": 0.0}]
    costs = calibration(store, config.run, nodes)
    assert set(costs.engines) == set(costs.trainers) == {"solver", "verifier"}
    assert all(engine.step + engine.per_sequence > 0 for engine in costs.engines.values())
    assert all(trainer.call + trainer.per_token > 0 for trainer in costs.trainers.values())
    rollouts = store.read_stage(config.run, "rollouts", columns=["step", "agent", "policy_version"])
    assert len(costs.episodes) == 3 * 2 * 4 * 4  # every stored episode is the workload, in its turns
    assert sum(len(episode) for episode in costs.episodes) == rollouts.num_rows
    # the driver's CPU, recorded with each version, spread over the turns between the first and last one kept
    per_turn = []
    for agent in ("solver", "verifier"):
        first, last = (json.loads(store.policy_file(config.run, agent, version, "timing.json")) for version in (2, 3))
        spent = last["driver_cpu_seconds"] - first["driver_cpu_seconds"]
        assert spent > 0 and (first["step"], last["step"]) == (1, 2)
        per_turn.append(spent / (rollouts.num_rows / 3))
    assert costs.driver_per_turn == pytest.approx(sum(per_turn) / 2)  # 2 records: too few to fit per message
    # each record also counts the driver's rollout messages and the engines' and trainer's CPU so far (the demo's
    # agents are hybrid: each its part of the one process)
    for key in ("driver_messages", "engine_cpu_seconds", "trainer_cpu_seconds", "engine_steps"):
        assert 0 < first[key] < last[key], key
    assert last["engine_step_sequences"] - first["engine_step_sequences"] > last["engine_steps"] - first["engine_steps"]
    assert all(turn.observe_seconds == 0 for episode in costs.episodes for turn in episode)  # the demo: no observe
    assert 0 < costs.handoff < min(measured)  # a micro-batch handed from stage to stage: committed, a thread woken

    _, prediction = predict(config, nodes, costs)
    # the simulated launch samples the stored launch's turns, each at the version the stored one used (staleness 0:
    # its own step's), and steps as many times
    recorded = sorted(zip(rollouts.column("step").to_pylist(), rollouts.column("agent").to_pylist(),
                          rollouts.column("policy_version").to_pylist()))
    simulated = sorted((d.step, d.agent, d.version) for d in prediction.decisions)
    assert simulated == recorded
    assert pc.all(pc.equal(rollouts.column("policy_version"), rollouts.column("step"))).as_py()
    assert len(prediction.step_seconds) == len(measured) == 3
    # a sanity bound on the in-sample fit, not a speed goal (BENCHMARKS.md has the validation on unseen launches)
    assert 0.5 < prediction.mean_step_seconds / (sum(measured) / len(measured)) < 2.0

    profile = tmp_path / "threads.json"  # what marl profile threads writes
    profile.write_text(json.dumps({"cpu": "here", "trainer": {"1": 1.0, "2": 1.5}}))
    result = subprocess.run(
        [sys.executable, "-m", "assets.cli", "plan", str(ROOT / "configs" / "demo.yaml"), "--calibrate",
         str(tmp_path / "store"), "--run", config.run, "--cluster", "2", "--set", "pipeline.steps=3",
         "--search", "--threads-profile", str(profile), "--format", "json"], cwd=ROOT, capture_output=True,
        text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert any(str(profile) in line and "2: 1.50x" in line for line in summary["assumptions"])
    assert len(summary["per_step"]) == 3 and summary["step_seconds"] > 0
    found = summary["search"]  # best first; the first is at least as good as the experiment as written
    assert found and found[0]["step_seconds"] <= summary["step_seconds"] + 1e-9
    assert [c["step_seconds"] for c in found] == sorted(c["step_seconds"] for c in found)
    assert summary["placement"]["solver/engine"].endswith("in one process with solver's trainer")  # demo: hybrid
    # the same from the UI: the capacity_plan asset, planning the demo on 2 CPUs with the stored run's costs
    import dagster as dg
    import yaml

    from assets.planning import capacity_plan
    from resources import ExperienceStoreResource, ExperimentResource

    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump({**small_config_data(demo_config_data, tmp_path / "store", steps=3)}))
    experiment = ExperimentResource(config_path=str(config_path))
    result = dg.materialize([capacity_plan], resources={"experiment": experiment,
                                                        "store": ExperienceStoreResource(experiment=experiment)},
                            run_config={"ops": {"capacity_plan": {"config": {"cluster": "2", "steps": 3,
                                                                             "search": True}}}})
    metadata = result.asset_materializations_for_node("capacity_plan")[0].metadata
    assert metadata["step_seconds"].value == pytest.approx(prediction.mean_step_seconds, abs=1e-4)  # one simulation
    assert metadata["bound"].value == prediction.bound and "data:image/png;base64," in metadata["busy"].value
    found = metadata["search"].value  # the CLI's options, through the same plan_capacity
    assert found and found[0]["step_seconds"] <= metadata["step_seconds"].value + 1e-9
    # beside every prediction, the calibration run simulated again against its step time measured from the store
    # (issue 71.6): the same simulation as above over steps 1.., and close to what its StepFinished events said
    (checked,) = metadata["calibration_error"].value
    assert checked["run"] == config.run
    assert checked["predicted_s"] == pytest.approx(sum(prediction.step_seconds[1:]) / 2, rel=1e-6)
    # the store's step_finished are the launch's own step ends: the same seconds as its events, to the microsecond
    assert checked["measured_s"] == pytest.approx(sum(measured[1:]) / 2, abs=1e-5)
    assert checked["error"] == pytest.approx(checked["predicted_s"] / checked["measured_s"] - 1)
    (told,) = summary["calibration_error"]  # the CLI's, with the threads profile: its own simulation
    assert told["measured_s"] == checked["measured_s"]
    shown = subprocess.run(
        [sys.executable, "-m", "assets.cli", "plan", str(ROOT / "configs" / "demo.yaml"), "--calibrate",
         str(tmp_path / "store"), "--run", config.run, "--cluster", "2"], cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert shown.returncode == 0 and f"the calibration run simulated again: {config.run} " in shown.stdout
    # the host's crowding exponent fitted on stored launches (here the one, checked against itself): a row each
    fitted = subprocess.run(
        [sys.executable, "-m", "assets.cli", "profile", "crowding", str(tmp_path / "store"), "--calibrate",
         config.run, "--run", config.run, "--grid", "0", "--grid", "0.2"], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert fitted.returncode == 0, fitted.stdout + fitted.stderr
    assert re.search(r"fit: crowding (0|0\.2) \(least root mean square error\)", fitted.stdout), fitted.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "assets.cli", "profile", "crowding", str(tmp_path / "store"), "--calibrate",
         config.run, "--run", config.run, "--grid", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "crowding exponents [3.0]" in refused.stdout

    refused = subprocess.run(
        [sys.executable, "-m", "assets.cli", "plan", str(ROOT / "configs" / "demo.yaml"), "--calibrate",
         str(tmp_path / "store"), "--run", config.run, "--run", "nothing-here", "--cluster", "2"], cwd=ROOT,
        capture_output=True, text=True, timeout=120)  # --run repeated: the costs of each, pooled
    assert refused.returncode == 2 and "run 'nothing-here' has no recorded launch" in refused.stdout


@pytest.mark.launch
def test_the_routers_and_the_gates_decisions_replay_as_a_run_made_them(local_ray, demo_config_data: dict,
                                                                        tmp_path: Path) -> None:
    from marl_pipeline.planner.replay import replay_gate, replay_routing

    data = small_config_data(demo_config_data, tmp_path / "store", steps=4)
    data["store"] = {"uri": str(tmp_path / "store"), "retention": {"keep_all": True}}  # every version's timing
    for agent in data["agents"].values():
        agent["engine"]["replicas"] = 2
    config = parse_config(data)
    assert isinstance(list(train(config))[-1], RunFinished)
    store = ExperienceStore(config.store)
    routing = replay_routing(store, config.run, {"solver": 2, "verifier": 2})
    assert routing.decisions == 4 * 2 * 16 * 2 and routing.differing == []  # every turn on the replica it had
    gate = replay_gate(store, config.run, staleness=0)
    assert gate.decisions == 3 and gate.differing == []  # steps 1-3 released when their versions were served


def test_without_a_cluster_the_plan_is_for_the_ray_cluster_it_can_see(local_ray) -> None:
    """`marl plan` with no --cluster plans on the nodes of the Ray cluster it is connected to (here: a local one of
    2 CPUs, as if reached at its address)."""
    from marl_pipeline.planner.plan import describe_nodes, ray_cluster_nodes

    nodes = ray_cluster_nodes(None)
    assert [(node["CPU"], node["GPU"]) for node in nodes] == [(2.0, 0.0)]
    assert describe_nodes(nodes) == "1 x 2 CPU" and describe_nodes(parse_cluster("3x96:8") + nodes) == (
        "3 x 96 CPU, 8 GPU + 1 x 2 CPU")
