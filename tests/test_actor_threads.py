"""Threads of the engine and trainer actors: the config's ``threads``, or the actor's share of the cluster's CPUs."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from marl_pipeline.cluster.cores import IDLE_CORES, CoreSplit, CpuReport, cores_used, demand_threads
from marl_pipeline.cluster.placement import plan_placement
from marl_pipeline.cluster.spawn import plan_on_ray, start_trainers
from marl_pipeline.cluster.specs import shared_threads
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.store import ExperienceStore
from tests.conftest import hybrid_agents


def test_shared_threads_split_the_cpus_by_reservation() -> None:
    # the demo on 2 cores: two agents, engine and trainer 0.5 CPU each -> one thread each (the CPUs are shared)
    assert shared_threads(0.5, [0.5] * 4, cluster_cpus=2, node_cpus=2) == 1
    # one agent on 8 cores: half each
    assert shared_threads(0.5, [0.5, 0.5], cluster_cpus=8, node_cpus=8) == 4
    # weighted by num_cpus: an engine reserving 1.5 of 2 CPUs gets 3 of 4 cores, its trainer 1
    assert [shared_threads(c, [1.5, 0.5], cluster_cpus=4, node_cpus=4) for c in (1.5, 0.5)] == [3, 1]
    # never more than one node's CPUs, never fewer than 1
    assert shared_threads(1, [1], cluster_cpus=32, node_cpus=8) == 8
    assert shared_threads(0.1, [0.1] * 40, cluster_cpus=2, node_cpus=2) == 1
    # nothing reserved: equal shares
    assert shared_threads(0, [0, 0, 0, 0], cluster_cpus=8, node_cpus=8) == 2


def test_threads_below_one_are_a_config_error(demo_config_data: dict, tmp_path: Path) -> None:
    solver = {**demo_config_data["agents"]["solver"], "trainer": {"threads": 0}}
    agents = {**demo_config_data["agents"], "solver": solver}
    with pytest.raises(ConfigError, match=r"agents\.solver\.trainer\.threads"):
        parse_config({**demo_config_data, "store": str(tmp_path), "agents": agents})


@pytest.mark.launch
def test_trainer_actors_compute_on_their_threads(local_ray, demo_config_data: dict, tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    import torch

    agents = {"solver": {**demo_config_data["agents"]["solver"], "trainer": {"threads": 2}},
              "verifier": demo_config_data["agents"]["verifier"]}
    config = parse_config({**demo_config_data, "store": str(tmp_path / "store"), "agents": agents})
    store = ExperienceStore(tmp_path / "store")
    for agent in config.agents:
        shutil.copytree(tiny_model_dir, store.policy_dir(config.run, agent, 0))
    # local_ray has 2 CPUs for four 0.5-CPU actors: the verifier's default share is one thread
    plan = plan_on_ray(config)
    assert [spec.threads for spec in plan.specs if spec.role == "trainer"] == [2, 1]
    trainers = start_trainers(plan, store, {agent: 0 for agent in config.agents})
    try:
        # in the actor's process, from a method call (not only its constructor): what the forward passes get
        threads = {agent: local_ray.get(handle.__ray_call__.remote(lambda self: torch.get_num_threads()))
                   for agent, handle in trainers.items()}
        assert threads == {"solver": 2, "verifier": 1}
    finally:
        for handle in trainers.values():
            local_ray.kill(handle)


def test_engines_and_trainers_taking_turns_each_get_the_cores(demo_config_data: dict, tmp_path: Path) -> None:
    def threads(agents: list[str], mode: str, cpus: float) -> tuple[int, int]:
        environment = {**demo_config_data["environment"], "name": "arithmetic_solo" if len(agents) == 1 else
                       demo_config_data["environment"]["name"]}
        config = parse_config({**demo_config_data, "store": str(tmp_path), "environment": environment,
                               "agents": {name: demo_config_data["agents"][name] for name in agents},
                               "pipeline": {**demo_config_data["pipeline"], "mode": mode}})
        plan = plan_placement(config, [{"CPU": cpus}])
        return plan.agent_specs("solver", "engine")[0].threads, plan.agent_specs("solver", "trainer")[0].threads

    # streaming: an agent's engine samples while its trainer trains, so all four (or both) share the cores
    assert threads(["solver", "verifier"], "streaming", 2) == (1, 1)
    assert threads(["solver"], "streaming", 2) == (1, 1)
    assert threads(["solver", "verifier"], "streaming", 8) == (2, 2)
    # synchronous: the step's rollout, then its training; each kind shares the cores only with its own kind
    assert threads(["solver"], "synchronous", 2) == (2, 2)
    assert threads(["solver", "verifier"], "synchronous", 2) == (1, 1)
    assert threads(["solver", "verifier"], "synchronous", 8) == (4, 4)


def test_demand_threads_follow_the_cores_used() -> None:
    # SmolLM2 alone on 2 cores: the trainer computes 90% of the step on one thread, its engine 30%; and when the
    # trainer has 2 threads, it uses 1.5 cores and keeps them
    assert demand_threads({"solver/trainer": 0.9, "solver/engine/0": 0.3}, cores=2) == {"solver/trainer": 2,
                                                                                         "solver/engine/0": 1}
    assert demand_threads({"solver/trainer": 1.5, "solver/engine/0": 0.35}, cores=2)["solver/trainer"] == 2
    # the demo: four actors mostly busy at once keep one thread each
    assert set(demand_threads({"a": 0.8, "b": 0.7, "c": 0.5, "d": 0.4}, cores=2).values()) == {1}
    # 16 cores, a trainer three times as busy as its engine: 12 and 4
    assert demand_threads({"t": 0.9, "e": 0.3}, cores=16) == {"t": 12, "e": 4}
    assert demand_threads({"t": 0.02, "e": 0.01}, cores=2) == {}  # idle: nothing moves


def test_cores_used_are_cpu_seconds_over_seconds() -> None:
    before = CpuReport("node", 7, seconds=10.0, cpu_seconds=3.0, threads=2)
    assert cores_used(before, CpuReport("node", 7, 12.0, 6.0, 2)) == pytest.approx(1.5)
    assert cores_used(before, CpuReport("node", 8, 12.0, 6.0, 2)) is None  # a restarted actor: another process


@pytest.mark.launch
def test_a_busy_trainer_takes_the_cores_its_idle_neighbour_leaves(local_ray, demo_config_data: dict,
                                                                   tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    config = parse_config({**demo_config_data, "store": str(tmp_path / "store")})
    store = ExperienceStore(tmp_path / "store")
    for agent in config.agents:
        shutil.copytree(tiny_model_dir, store.policy_dir(config.run, agent, 0))
    trainers = start_trainers(plan_on_ray(config), store, {agent: 0 for agent in config.agents})
    try:
        def threads() -> dict[str, int]:
            return {agent: local_ray.get(handle.__ray_call__.remote(lambda self: torch.get_num_threads()))
                    for agent, handle in trainers.items()}

        assert threads() == {"solver": 1, "verifier": 1}  # four 0.5-CPU actors on 2 cores
        split = CoreSplit({f"{agent}/trainer": handle for agent, handle in trainers.items()},
                          {"solver/trainer", "verifier/trainer"}, {local_ray.get_runtime_context().get_node_id(): 2})
        assert split.after_step() == ({}, {})  # the first reports: nothing to compare yet

        def spin(self, seconds: float) -> None:  # the solver's trainer computes for a step; the verifier's waits
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass

        local_ray.get(trainers["solver"].__ray_call__.remote(spin, 1.0))
        time.sleep(0.5)
        changed, used = split.after_step()
        # Busy against idle, as the split reads them: how many cores the busy one got depends on what else the
        # machine runs (0.46 of a core beside the other pytest worker, 0.25 with a benchmark too), its share does not.
        assert used["solver/trainer"] > IDLE_CORES and used["solver/trainer"] > 10 * used["verifier/trainer"], used
        assert changed == {"solver/trainer": (1, 2)}
        assert threads() == {"solver": 2, "verifier": 1}  # set in the actor, seen by its next call
        time.sleep(1.0)
        assert split.after_step()[0] == {}  # both idle since: nothing moves
    finally:
        for handle in trainers.values():
            local_ray.kill(handle)


@pytest.mark.launch
def test_a_hybrid_agents_process_reports_engine_and_trainer_apart_and_its_trainer_takes_the_idle_cores(
        local_ray, demo_config_data: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    data = hybrid_agents({**demo_config_data, "store": str(tmp_path / "store"),
                          "environment": {**demo_config_data["environment"], "name": "arithmetic_solo"},
                          "agents": {"solver": demo_config_data["agents"]["solver"]}})
    config = parse_config(data)
    store = ExperienceStore(tmp_path / "store")
    shutil.copytree(tiny_model_dir, store.policy_dir(config.run, "solver", 0))
    placement = plan_on_ray(config)
    trainer = start_trainers(placement, store, {"solver": 0})["solver"]  # the agent's process
    process = trainer.actor
    try:
        def on_trainer_lane(function, *args):  # as the trainer's calls run: on its training lane's thread
            return local_ray.get(process.__ray_call__.remote(
                lambda self: self._lanes["train"].thread.submit(function, *args).result()))

        assert on_trainer_lane(torch.get_num_threads) == 1  # engine and trainer share 2 cores
        split = CoreSplit.for_run(placement, {}, {"solver": trainer})
        split.actors["solver/engine/0"] = process  # the engine's part of the same process
        assert split.movable == {"solver/trainer"}
        split.after_step()

        def spin(seconds: float) -> None:  # the trainer computes for a step; the engine waits
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass

        on_trainer_lane(spin, 1.0)
        time.sleep(0.3)
        changed, used = split.after_step()
        assert used["solver/trainer"] > IDLE_CORES, used  # one process, two reports: busy against idle, as above
        assert used["solver/trainer"] > 10 * used["solver/engine/0"], used
        assert changed == {"solver/trainer": (1, 2)}
        assert local_ray.get(trainer.policy_version.remote()) == 0  # the training lane's next call, in turn
        assert on_trainer_lane(torch.get_num_threads) == 2  # set on the lane's thread
    finally:
        local_ray.kill(process)
