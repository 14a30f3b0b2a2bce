"""The replica router, without engines: sticky episodes, least outstanding, saturation, down and draining replicas;
and replicas counted by the config and the placement plan."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.inference.router import NoReplica, Router, split_replicas
from marl_pipeline.stages.rollout import token_demand
from tests.round_robin import RoundRobinRouter


def test_an_episode_stays_on_the_replica_that_served_its_first_turn() -> None:
    router = Router(3)
    first = {episode: router.acquire(episode) for episode in "abc"}
    assert sorted(first.values()) == [0, 1, 2]  # each new episode to the least loaded
    for episode in "abc":
        router.release(first[episode])
    router.acquire("x")  # replica 0 now busier than the others
    for _ in range(3):
        assert router.acquire("b") == first["b"]  # sticky, whatever the load
        router.release(first["b"])


def test_a_new_episode_goes_to_the_least_loaded_replica_and_waits_when_all_are_saturated() -> None:
    router = Router(2, max_outstanding=2)
    assert [router.acquire(e) for e in "abcd"] == [0, 1, 0, 1]
    assert router.acquire("e") is None  # both at 2: a new episode waits
    assert router.acquire("a") == 0  # a sticky turn is not refused (the limit places new episodes)
    router.release(1)
    assert router.acquire("e") == 1
    assert router.outstanding() == [3, 2]


def test_a_down_replica_gets_nothing_and_its_episodes_move() -> None:
    router = Router(2)
    assert router.acquire("a") == 0
    router.release(0)
    router.mark_down(0)
    assert router.acquire("a") == 1  # moved, and sticky there from now on
    router.mark_up(0)
    assert router.acquire("a") == 1
    router.mark_down(0)
    router.mark_down(1)
    with pytest.raises(NoReplica, match="all 2 replicas are down"):
        router.acquire("b")


def test_a_new_episode_keeps_the_lane_of_its_previous_turn_where_the_agents_have_as_many_replicas() -> None:
    router = Router(2, max_outstanding=3)
    # its previous turn ran on replica 1 of an agent with two: replica 1 too, though replica 0 is less loaded
    assert [router.acquire(e, (2, 1)) for e in "abc"] == [1, 1, 1]
    assert router.acquire("d", (2, 1)) == 0  # its lane saturated: the least outstanding
    assert [router.acquire("e", (1, 0)), router.acquire("f", (3, 1))] == [0, 0]  # another count: no lane
    assert router.acquire("a", (2, 0)) == 1  # an episode placed here before stays here
    assert router.outstanding() == [3, 4]
    router.release(1)
    router.release(1)
    router.set_draining(1, True)
    assert router.acquire("g", (2, 1)) is None  # its lane draining, the other saturated: it waits
    router.set_draining(1, False)
    assert router.acquire("g", (2, 1)) == 1


def test_a_draining_replica_takes_no_new_episode_but_keeps_its_own() -> None:
    router = Router(2)
    assert router.acquire("a") == 0
    router.release(0)
    router.set_draining(0, True)
    assert [router.acquire(e) for e in "bcd"] == [1, 1, 1]
    assert router.acquire("a") == 0
    router.set_draining(1, True)  # every replica reloading: they hold requests, so one still takes it
    assert router.acquire("e") == 0


def test_the_round_robin_baseline_ignores_episodes() -> None:
    router = RoundRobinRouter(2)  # bench/pipeline/rollout.py's baseline
    assert [router.acquire("a") for _ in range(4)] == [0, 1, 0, 1]
    assert router.outstanding() == [2, 2]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": 0}, "replicas must be an int >= 1"),
    ({"replicas": 2, "max_outstanding": 0}, "max_outstanding must be >= 1"),
])
def test_bad_router_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Router(**kwargs)


def test_releasing_more_than_was_acquired_is_an_error() -> None:
    with pytest.raises(ValueError, match="replica 1 has no outstanding request"):
        Router(2).release(1)


def test_replicas_are_validated_in_the_config(demo_config_data: dict) -> None:
    data = copy.deepcopy(demo_config_data)
    data["agents"]["solver"].setdefault("engine", {})["replicas"] = 0
    with pytest.raises(ConfigError, match=r"agents\.solver\.engine\.replicas:"):
        parse_config(data)
    data["agents"]["solver"]["engine"]["replicas"] = 2
    assert parse_config(data).agents["solver"].engine.replicas == 2


def test_the_placement_plan_reserves_every_replica(demo_config_data: dict) -> None:
    data = copy.deepcopy(demo_config_data)
    for agent in data["agents"].values():
        agent.setdefault("engine", {}).update(num_cpus=0.5)
        agent.setdefault("trainer", {}).update(num_cpus=0.5)
    data["agents"]["solver"]["engine"]["replicas"] = 3
    config = parse_config(data)
    plan = plan_placement(config, [{"CPU": 8.0}])
    names = [actor.name for actor in plan.actors]
    assert [n for n in names if n.startswith("solver/engine")] == ["solver/engine/0", "solver/engine/1",
                                                                     "solver/engine/2"]
    assert plan.summary()["total"].startswith(f"{0.5 * (3 + 1 + 2):g} of 8 CPU")
    with pytest.raises(PlacementError, match=r"solver: engine 3 replicas x 0.5 \+ trainer 0.5"):
        plan_placement(config, [{"CPU": 2.0}])


@pytest.mark.parametrize(("demand", "total", "expected"), [
    ({"a": 300, "b": 100}, 4, {"a": 3, "b": 1}),
    ({"a": 1000, "b": 1}, 4, {"a": 3, "b": 1}),  # at least one each
    ({"a": 1, "b": 1, "c": 1}, 4, {"a": 2, "b": 1, "c": 1}),  # ties to the earlier agent
    ({"a": 0, "b": 0}, 4, {"a": 2, "b": 2}),
    ({"a": 50, "b": 30, "c": 20}, 10, {"a": 5, "b": 3, "c": 2}),
])
def test_replicas_are_split_across_agents_in_proportion_to_token_demand(demand, total, expected) -> None:
    assert split_replicas(demand, total) == expected


def test_a_split_that_cannot_give_every_agent_a_replica_is_refused() -> None:
    with pytest.raises(ValueError, match="3 replicas cannot give each of 4 agents one"):
        split_replicas({"a": 1, "b": 1, "c": 1, "d": 1}, 3)


def test_token_demand_counts_prompt_and_response_tokens_per_agent() -> None:
    rollouts = pa.table({"agent": ["a", "b", "a"], "prompt_ids": [[1, 2, 3], [4], [5, 6]],
                         "response_ids": [[7], [8, 9], []]})
    assert token_demand(rollouts, ["a", "b", "c"]) == {"a": 6, "b": 3, "c": 0}


def test_rebalancing_needs_engines_that_ask_alike(demo_config_data: dict) -> None:
    data = copy.deepcopy(demo_config_data)
    data.setdefault("pipeline", {}).setdefault("rollout", {})["rebalance_replicas"] = True
    assert parse_config(data).pipeline.rollout.rebalance_replicas
    data["agents"]["solver"].setdefault("engine", {})["num_cpus"] = 1.0
    with pytest.raises(ConfigError, match=r"pipeline\.rollout\.rebalance_replicas: moves replicas between agents"):
        parse_config(data)
