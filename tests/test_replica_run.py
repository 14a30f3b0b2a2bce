"""A whole training run with two engine replicas for its one agent, one of them killed with SIGKILL after the
first micro-batch is committed: the run finishes, every turn of every micro-batch is stored exactly once, the
staleness bound holds per turn in the store, and a replacement for the dead replica was started (that it comes
back at the current version is tests/test_replicas.py's: here the run may end first).

One agent (the solver answering twice), so that two replicas are the most engines alive on the test machine."""

from __future__ import annotations

import copy
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import ray

from environments.arithmetic import ArithmeticCheck
from marl_pipeline.cluster import warm_actors
from marl_pipeline.config import parse_config
from marl_pipeline.environment import ActionResult, Task, Turn, register_environment
from marl_pipeline.run.events import ReplicaChanged, RunFinished, StageCommitted
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch

STEPS, MICRO_BATCHES, PROMPTS, SAMPLES, STALENESS = 4, 2, 4, 4, 1


@register_environment
class SoloArithmetic(ArithmeticCheck):
    """The solver answers ``a+b=``, then answers again after seeing its first answer (its second turn extends
    the first turn's prompt: what sticky routing is for); scored on the first answer."""

    name = "arithmetic_solo"
    turn_order = ("solver", "solver")

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        question = f"{task['a']}+{task['b']}="
        return question if not transcript else f"{question}{transcript[0].text.strip()[:4]} {question}"

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        first = super().execute(task, [transcript[0], Turn("verifier", "yes")])[0]
        return [first, ActionResult("again", True)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": float(results[0].success)}


def _engines() -> dict[str, dict]:
    """The run's engine actors in Ray's own actor table, dead ones included."""
    return {actor_id: info for actor_id, info in ray._private.state.actors().items()
            if info["ActorClassName"] == "StoreAsyncEngine"}


def test_a_replica_killed_mid_run_loses_nothing_and_the_run_finishes(local_ray, demo_config_data,
                                                                     tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store", steps=STEPS, micro_batches_per_step=MICRO_BATCHES,
                             prompts_per_micro_batch=PROMPTS, samples_per_prompt=SAMPLES, staleness=STALENESS)
    data["environment"] = {"name": "arithmetic_solo", "options": copy.deepcopy(data["environment"].get("options", {}))}
    solver = data["agents"]["solver"]
    solver["engine"] = {"replicas": 2, "kv_cache_gib": 0.05}  # a share of memory would count the engine process too
    data["pipeline"]["rollout"] = {"rebalance_replicas": True}  # one agent: the split is 2, run between steps
    data["agents"] = {"solver": solver}
    data["ray"]["keep_actors"] = False  # this test checks that the run's shutdown leaves no replica behind
    config = parse_config(data)
    before = set(_engines())
    registered = warm_actors.in_use()  # other modules' launches may have left entries (not this test's concern)
    killed = None
    events = []
    for event in train(config):
        events.append(event)
        if killed is None and isinstance(event, StageCommitted) and event.stage == "rollouts":
            alive = [info for actor_id, info in _engines().items()
                     if actor_id not in before and info["State"] == "ALIVE"]
            assert len(alive) == 2
            killed = alive[0]
            os.kill(killed["Pid"], signal.SIGKILL)  # a real fault, while the run goes on
    assert isinstance(events[-1], RunFinished)
    # The run told its caller (the train op's log) of the death; of the restart too, unless the run ended first.
    changes = [(e.agent, e.state) for e in events if isinstance(e, ReplicaChanged)]
    assert changes in ([("solver", "down")], [("solver", "down"), ("solver", "up")]), changes
    assert warm_actors.in_use() == registered  # the run released every actor it started, the killed replica too

    store = ExperienceStore(config.store)
    rollouts = store.read_stage(config.run, "rollouts", columns=["sample_id", "step", "micro_batch", "policy_version",
                                                                 "engine", "status"]).to_pylist()
    per_micro_batch = Counter((row["step"], row["micro_batch"]) for row in rollouts)
    assert sorted(per_micro_batch) == [(s, m) for s in range(STEPS) for m in range(MICRO_BATCHES)]
    assert set(per_micro_batch.values()) == {PROMPTS * SAMPLES * 2}  # every turn of every episode...
    assert set(Counter((r["step"], r["micro_batch"], r["sample_id"]) for r in rollouts).values()) == {1}  # ...once
    assert all(0 <= row["step"] - row["policy_version"] <= STALENESS for row in rollouts)  # per turn, from the store
    assert {row["engine"] for row in rollouts} == {"solver/0", "solver/1"}
    assert store.policy_versions(config.run, "solver")[-1] == STEPS
    created = {actor_id: info for actor_id, info in _engines().items() if actor_id not in before}
    assert len(created) >= 3, "no replacement was started for the killed replica"
    assert not [info for info in created.values() if info["State"] == "ALIVE"]  # the run's shutdown killed them all


def test_replica_changes_are_warnings_and_errors_in_the_runs_log() -> None:
    """How the train op records a replica's death and restart (assets/train.py) on a real Dagster instance."""
    import logging

    import dagster as dg

    from assets.train import _log_replica

    changes = [ReplicaChanged("solver", 1, "down"), ReplicaChanged("solver", 1, "up", 3),
               ReplicaChanged("verifier", 0, "failed", detail="RayActorError('no node')")]

    @dg.op
    def report(context) -> None:  # not annotated: this module's annotations are strings, Dagster evaluates them
        for change in changes:
            _log_replica(context, change)

    @dg.job
    def replica_log() -> None:
        report()

    with dg.instance_for_test() as instance:
        result = replica_log.execute_in_process(instance=instance)
        logged = [(entry.level, entry.user_message) for entry in instance.all_logs(result.run_id)
                  if entry.dagster_event is None]
    assert [level for level, _ in logged] == [logging.WARNING, logging.WARNING, logging.ERROR]
    down, up, failed = (message for _, message in logged)
    assert "engine replica solver/1 died" in down and "other replicas" in down
    assert "engine replica solver/1 restarted" in up and "policy version 3" in up
    assert "engine replica verifier/0 could not be restarted" in failed and "RayActorError('no node')" in failed
