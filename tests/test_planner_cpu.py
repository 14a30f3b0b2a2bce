"""The driver's CPU as the calibration run measured it (planner/cpu.py) and as the simulation charges it: per turn,
and per rollout message, of which an agent with more replicas sends more."""

from __future__ import annotations

import copy
from dataclasses import replace
from itertools import pairwise

import pyarrow as pa
import pytest

from marl_pipeline.cluster.placement import plan_placement
from marl_pipeline.config import parse_config
from marl_pipeline.planner.costs import Costs, EngineCosts, TrainerCosts, Turn
from marl_pipeline.planner.cpu import driver_rates
from marl_pipeline.planner.simulate import simulate

ENGINE = EngineCosts(step=0.01, per_sequence=0.0005, per_prompt_token=0.0)
TRAINER = TrainerCosts(call=0.05, per_token=0.0002, apply=0.1, sync_per_replica=0.05, commit=0.2)


def _rollouts(steps: int, turns_per_step: int) -> pa.Table:
    return pa.table({"step": [s for s in range(steps) for _ in range(turns_per_step)]})


def test_the_drivers_cpu_is_fitted_per_turn_and_per_message() -> None:
    # 100 turns a step; the driver spends 0.2 s a step plus 2 ms a message, with a different count each step
    messages = [0, 50, 130, 160, 300, 320, 500]
    spent = [0.0]
    for before, after in pairwise(messages):
        spent.append(spent[-1] + 0.2 + 0.002 * (after - before))
    records = {("a", step): {"step": step, "driver_cpu_seconds": cpu, "driver_messages": count}
               for step, (cpu, count) in enumerate(zip(spent, messages))}
    # 500 messages over 6 steps of 100 turns, on 2 replicas an agent
    assert driver_rates(_rollouts(7, 100), records, replicas=2.0) == pytest.approx(
        {"driver_per_turn": 0.002, "driver_per_message": 0.002, "messages_per_turn": 500 / 600 / 2})
    # a run stored before messages were counted: all of it per turn, over the steps between the first and last record
    older = {key: {k: v for k, v in record.items() if k != "driver_messages"} for key, record in records.items()}
    assert driver_rates(_rollouts(7, 100), older) == pytest.approx(
        {"driver_per_turn": spent[-1] / 6 / 100, "driver_per_message": 0.0, "messages_per_turn": 0.0})
    assert driver_rates(_rollouts(7, 100), {}) == {"driver_per_turn": 0.0, "driver_per_message": 0.0,
                                                   "messages_per_turn": 0.0}


def test_an_agent_with_more_replicas_costs_the_driver_more_messages(demo_config_data: dict) -> None:
    """Two replicas split each wave into two calls and each step's results into two chunks: the driver is charged the
    calibration's messages per turn and replica times the agent's replicas."""

    def driver(replicas: int, costs: Costs) -> float:
        data = copy.deepcopy(demo_config_data)
        data["pipeline"].update({"steps": 2})
        for agent in data["agents"].values():
            agent.pop("hybrid", None)
            agent["engine"] = {**agent.get("engine", {}), "replicas": replicas}
        config, nodes = parse_config(data), [{"CPU": 64.0}]
        return simulate(plan_placement(config, nodes), config.pipeline, costs, nodes).core_seconds["driver"]

    episodes = [[Turn("solver", 40, 4), Turn("verifier", 60, 2)]] * 64
    costs = Costs({"solver": ENGINE, "verifier": ENGINE}, {"solver": TRAINER, "verifier": TRAINER}, environment=0.05,
                  reward=0.05, rollout_overhead=0.1, train_overhead=0.05, episodes=episodes, source="hand-made",
                  driver_per_turn=0.0001)  # a driver far from busy: all it is charged is done within the run
    turns = 2 * 256 * 2  # a step: 2 micro-batches of 256 episodes, 2 turns each
    alone = driver(1, costs)
    assert alone == pytest.approx(turns * 0.0001)
    messaging = replace(costs, driver_per_message=0.0002, messages_per_turn=0.1)
    assert driver(1, messaging) == pytest.approx(turns * (0.0001 + 0.0002 * 0.1))
    assert driver(2, messaging) == pytest.approx(turns * (0.0001 + 0.0002 * 0.1 * 2))
