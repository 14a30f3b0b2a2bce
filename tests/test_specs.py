"""The placement plan's specs (cluster/specs.py): one per actor, holding what the spawner starts it with."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from marl_pipeline.cluster.placement import plan_placement
from marl_pipeline.config import parse_config
from tests.conftest import hybrid_agents

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = {"gpu": [{"CPU": 96.0, "GPU": 8.0}], "cpu": [{"CPU": 2.0}]}


def _reserved(plan) -> dict[str, float]:
    """CPUs and GPUs the specs reserve: an actor outside a group its own, a group its bundles once."""
    groups = {spec.group.name: spec.group for spec in plan.specs if spec.group is not None}
    totals = {"CPU": 0.0, "GPU": 0.0}
    for spec in plan.specs:
        if spec.group is None:
            totals["CPU"] += spec.cpus
            totals["GPU"] += spec.gpus
    for group in groups.values():
        for bundle in group.bundles:
            for resource in totals:
                totals[resource] += bundle.get(resource, 0.0)
    return totals


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda path: path.stem)
def test_every_shipped_config_plans_one_spec_per_actor_reserving_what_the_plan_counts(path: Path) -> None:
    config = parse_config(yaml.safe_load(path.read_text()))
    plan = plan_placement(config, CLUSTERS["gpu" if "gpu" in path.stem else "cpu"])
    names = [spec.name for spec in plan.specs]
    assert len(names) == len(set(names))
    used = {r: sum(getattr(a, f"{r.lower()}s") for a in plan.actors) for r in ("CPU", "GPU")}
    assert _reserved(plan) == pytest.approx(used)
    for agent, agent_config in config.agents.items():  # every replica, and every trainer rank, is started
        engines = plan.agent_specs(agent, "engine")
        assert len(engines) == agent_config.engine.replicas
        assert all(spec.loads == (agent,) for spec in engines)
        trainers = plan.agent_specs(agent, "trainer")
        assert len(trainers) == (1 if agent_config.hybrid else agent_config.trainer.workers)
        assert {spec.options.get("lr", agent_config.trainer.lr) for spec in trainers} == {agent_config.trainer.lr}
    assert pickle.loads(pickle.dumps(plan.specs)) == plan.specs  # what Ray hands a sharded trainer's rank 0


def test_a_hybrid_agent_is_one_process_whose_slot_restarts_as_its_engine(demo_config_data: dict) -> None:
    config = parse_config(hybrid_agents(demo_config_data))
    plan = plan_placement(config, CLUSTERS["cpu"])
    process = plan.agent_specs("solver", "engine")[0]
    assert (process.name, process.role, process.cpus) == ("solver/engine+trainer", "agent-process", 1.0)
    engine, trainer = process.parts
    assert (engine.role, engine.cpus, engine.keep) == ("engine", 0.5, True)
    assert trainer.options["num_threads"] == trainer.threads == 1 and engine.options["threads"] == 1
    assert plan.summary()["solver/engine"] == "0.5 CPU, 0 GPU, in one process with solver's trainer"


def test_swapped_agents_are_served_each_by_one_worker_with_the_largest_request(demo_config_data: dict) -> None:
    agents = {**demo_config_data["agents"], "verifier": {**demo_config_data["agents"]["verifier"],
                                                         "trainer": {"num_cpus": 0.25}}}
    config = parse_config({**demo_config_data, "agents": agents, "ray": {"resident_trainers": 1}})
    plan = plan_placement(config, [{"CPU": 4.0}])
    (worker,) = [spec for spec in plan.specs if spec.role == "trainer-worker"]
    assert worker.loads == ("solver", "verifier") and set(worker.options) == {"solver", "verifier"}
    assert worker.cpus == 0.5 and not plan.agent_specs("solver", "trainer")
    assert worker.options["verifier"]["num_threads"] == worker.threads


def test_threads_are_the_configs_or_a_share_of_the_cores(demo_config_data: dict) -> None:
    agents = {**demo_config_data["agents"], "solver": {**demo_config_data["agents"]["solver"],
                                                       "trainer": {"threads": 3}}}
    config = parse_config({**demo_config_data, "agents": agents})
    plan = plan_placement(config, [{"CPU": 8.0}])
    threads = {spec.name: (spec.threads, spec.options.get("threads", spec.options.get("num_threads")))
               for spec in plan.specs}
    # four 0.5-CPU actors on 8 cores share them: 2 each, but the solver's trainer asked for 3
    assert threads == {"solver/engine": (2, 2), "solver/trainer": (3, 3), "verifier/engine": (2, 2),
                       "verifier/trainer": (2, 2)}
