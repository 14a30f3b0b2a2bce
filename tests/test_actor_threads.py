"""Threads of the engine and trainer actors: the config's ``threads``, or the actor's share of the cluster's CPUs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from marl_pipeline.cluster.spawn import actor_threads, shared_threads, start_trainers
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.store import ExperienceStore


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
    assert (actor_threads(config, config.agents["solver"].trainer),
            actor_threads(config, config.agents["verifier"].trainer)) == (2, 1)
    trainers = start_trainers(config, store, {agent: 0 for agent in config.agents})
    try:
        # in the actor's process, from a method call (not only its constructor): what the forward passes get
        threads = {agent: local_ray.get(handle.__ray_call__.remote(lambda self: torch.get_num_threads()))
                   for agent, handle in trainers.items()}
        assert threads == {"solver": 2, "verifier": 1}
    finally:
        for handle in trainers.values():
            local_ray.kill(handle)
