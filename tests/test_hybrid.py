"""An agent's trainer in its engine's process (``agents.<a>.hybrid``, cluster/hybrid.py): what the config and the
placement plan refuse, the lanes that run a trainer's calls in the order they were issued whatever order they
arrive in, the weights handed over in the agent's process and fetched from it by its other replicas, and real
launches: two agents in one process each end with the weights of the launch with separate trainer actors, and so does
a launch whose process was killed, once resumed, and a launch on the processes the one before kept."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from marl_pipeline.cluster import warm_actors
from marl_pipeline.cluster.engines import HeldWeights
from marl_pipeline.cluster.hybrid import _Lane
from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.cluster.spawn import plan_on_ray, start_engine_replicas, start_trainers
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.inference.router import NoReplica
from marl_pipeline.run.events import PolicyCommitted, RunFinished, StepFinished
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.batches import TrainBatch
from tests.conftest import actor_classes, hybrid_agents, small_config_data


def test_the_config_refuses_what_one_cpu_process_cannot_hold(demo_config_data: dict) -> None:
    parse_config(hybrid_agents(demo_config_data))
    with pytest.raises(ConfigError, match=r"hybrid: .* engine.num_gpus, trainer.workers differ"):
        parse_config(hybrid_agents(demo_config_data, engine={"num_gpus": 1}, trainer={"workers": 2}))
    with pytest.raises(ConfigError, match=r"hybrid and colocated: pick one"):
        parse_config(hybrid_agents(demo_config_data, colocated=True))
    with pytest.raises(ConfigError, match=r"agents \['solver', 'verifier'\] are hybrid: .*use ray.weight_sync: "
                                          r"object_store"):
        parse_config({**hybrid_agents(demo_config_data), "ray": {"weight_sync": "broadcast"}})
    with pytest.raises(ConfigError, match=r"ray.resident_trainers: 1 cannot swap"):
        parse_config({**hybrid_agents(demo_config_data), "ray": {"resident_trainers": 1}})


def test_the_plan_puts_a_hybrid_agents_engine_and_trainer_on_one_node(demo_config_data: dict) -> None:
    def config(hybrid: bool):
        data = {**demo_config_data, "agents": {name: {**settings, "hybrid": hybrid, "engine": {"num_cpus": 0.75},
                                                      "trainer": {"num_cpus": 0.75}}
                                               for name, settings in demo_config_data["agents"].items()}}
        return parse_config(data)

    nodes = [{"CPU": 1.0}] * 4  # room for each actor apart, not for an engine and its trainer together
    plan_placement(config(False), nodes)
    with pytest.raises(PlacementError, match=r"solver/engine\+trainer needs 1.5 CPU and 0 GPU on one node"):
        plan_placement(config(True), nodes)
    plan = plan_placement(config(True), [{"CPU": 3.0}])
    assert plan.summary()["solver/engine"] == "0.75 CPU, 0 GPU, in one process with solver's trainer"
    with pytest.raises(PlacementError, match=r"Swapping the trainers cannot help: agents \['solver', 'verifier'\] "
                                             r"are hybrid"):
        plan_placement(config(True), [{"CPU": 2.0}])


def test_a_lane_runs_calls_in_turn_order_on_one_thread_whatever_order_they_arrive_in() -> None:
    lane, ran = _Lane("train"), []

    def work(turn: int) -> int:
        ran.append((turn, threading.get_ident()))
        if turn == 1:
            raise ValueError("turn 1 fails")
        return turn

    async def main():
        # Turn 3 arrives first, turn 0 last (Ray starts an asynchronous actor's calls as their arguments arrive).
        calls = [asyncio.ensure_future(lane.call(turn, work, turn)) for turn in (3, 2, 1)]
        await asyncio.sleep(0.05)
        assert ran == []  # all wait for turn 0
        calls.append(asyncio.ensure_future(lane.call(0, work, 0)))
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert [turn for turn, _ in ran] == [0, 1, 2, 3]  # a failed call still passes the turn on
    assert len({thread for _, thread in ran}) == 1 and ran[0][1] != threading.get_ident()
    assert results[:2] == [3, 2] and isinstance(results[2], ValueError) and results[3] == 0


def _small(data: dict, store: Path):
    data = small_config_data(data, store, steps=3)
    data["store"] = {"uri": str(store), "retention": {"keep_all": True}}
    return parse_config(data)


@pytest.mark.launch
def test_a_hybrid_launch_runs_one_process_per_agent_and_trains_as_separate_actors_do(
        local_ray, demo_config_data, tmp_path: Path) -> None:
    stores = {}
    config = _small(demo_config_data, tmp_path / "apart")
    assert isinstance(list(train(config))[-1], RunFinished)
    stores["apart"] = ExperienceStore(config.store)
    # A hybrid process killed (as the OOM killer would) takes its trainer and the weights it held with it: the launch
    # stops with Ray's error (or the replica's restart's, which had no weights to load), and the next launch resumes
    # from the store to the uninterrupted run's parameters.
    config = _small(hybrid_agents(demo_config_data), tmp_path / "killed")
    before = set(actor_classes())
    with pytest.raises((ray.exceptions.RayActorError, NoReplica), match=r"(?i)died"):
        for event in train(config):
            if isinstance(event, StepFinished) and event.step == 0:
                alive = ray._private.state.actors(actor_state_name="ALIVE")
                os.kill(next(info["Pid"] for actor_id, info in alive.items()
                             if info["ActorClassName"] == "AgentProcess" and actor_id not in before), signal.SIGKILL)
    before = set(actor_classes())
    events = list(train(config))
    assert isinstance(events[-1], RunFinished)
    stores["killed"] = ExperienceStore(config.store)
    kept = {actor_id: cls for actor_id, cls in actor_classes().items() if actor_id not in before}
    assert sorted(kept.values()) == ["AgentProcess", "AgentProcess"]  # no trainer actor, no other engine
    # A clean launch keeps its processes (ray.keep_actors): the next one restarts them in place, new trainer and all,
    # and trains as new processes do.
    config = _small(hybrid_agents(demo_config_data), tmp_path / "hybrid")
    before = set(actor_classes())
    events = list(train(config))
    assert isinstance(events[-1], RunFinished)
    assert len([event for event in events if isinstance(event, PolicyCommitted)]) == 6
    assert set(actor_classes()) == before  # nothing started
    alive = ray._private.state.actors(actor_state_name="ALIVE")
    assert set(kept) <= set(alive)  # and kept idle again, for the next launch
    stores["hybrid"] = ExperienceStore(config.store)
    for agent in ("solver", "verifier"):
        apart, *others = (load_file(stores[n].policy_dir("demo", agent, 3) / "model.safetensors")
                          for n in ("apart", "hybrid", "killed"))
        for other in others:
            assert max((apart[k] - other[k]).abs().max().item() for k in apart) <= 1e-6, agent


@pytest.mark.launch
def test_a_hybrid_agents_weights_reach_its_engine_in_process_and_its_other_replicas_from_there(
        local_ray, demo_config_data: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    solver = demo_config_data["agents"]["solver"]
    data = hybrid_agents({**demo_config_data, "store": str(tmp_path / "store"),
                          "environment": {**demo_config_data["environment"], "name": "arithmetic_solo"},
                          "agents": {"solver": {**solver, "engine": {**solver.get("engine", {}), "replicas": 2},
                                                "trainer": {**solver["trainer"], "lr": 5e-2}}}})
    config = parse_config(data)
    store = ExperienceStore(tmp_path / "store")
    shutil.copytree(tiny_model_dir, store.policy_dir(config.run, "solver", 0))
    plan = plan_on_ray(config)
    trainer = start_trainers(plan, store, {"solver": 0})["solver"]  # the agent's process, its engine replica 0
    replicas = start_engine_replicas(plan, store, {"solver": 0}, first={"solver": trainer.actor})["solver"]
    warm_actors.stop_idle()  # as a launch does: the processes the test before kept hold the CPUs replica 1 waits for
    try:
        prompt, response = [17, 11, 18, 29], [20, 0]
        before = ray.get(replicas.handle(1).completion_logprobs.remote(prompt, response))
        ray.get(trainer.accumulate.remote(TrainBatch([prompt], [response], [before], [1.0])))
        ray.get(trainer.apply_step.remote())
        weights = trainer.named_weights.remote()
        held = ray.get(weights)
        assert isinstance(held, HeldWeights) and held.version == 1  # the tensors stayed in the agent's process
        assert replicas.load_weights(weights, 1) == 1  # replica 0 takes them there, replica 1 asks for them
        expected = ray.get(trainer.completion_logprobs.remote(prompt, response))
        for replica in range(2):
            served = ray.get(replicas.handle(replica).completion_logprobs.remote(prompt, response))
            assert served == pytest.approx(expected, abs=1e-4), replica
            assert max(abs(a - b) for a, b in zip(served, before)) > 1e-2, replica  # the new version, served
        # Once replica 0 serves version 1 the process lets older versions go: asking for one says so.
        with pytest.raises(ray.exceptions.RayTaskError, match="version 0 is no longer held here"):
            ray.get(replicas.handle(1).load_weights.remote(HeldWeights(trainer.actor, held.holder_id, 0), 0))
    finally:
        replicas.shutdown()
        ray.kill(trainer.actor)
