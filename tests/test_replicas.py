"""Two real engine replicas of one agent: a weight update mid-rollout (a broadcast from the trainer:
policy/transfer.py) records the version that sampled each turn (checked against each version's own logprobs, from
the store), and a replica killed with SIGKILL mid-rollout loses and duplicates nothing, is restarted (with the
trainer's staged copy of the version broadcast) and comes back at the current version.

Never more than two engines alive (a dead one's replacement starts after it died), each with a small KV cache."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from marl_pipeline.cluster import warm_actors
from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig, RolloutConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.inference.engine import GenerationRequest
from marl_pipeline.inference.replicas import EngineReplicas
from marl_pipeline.stages.rollout import RolloutSettings
from marl_pipeline.stages.trajectories import rollout_trajectories
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import with_stage_timing
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.timed_replies import TimedReplies

pytestmark = pytest.mark.launch

LOGPROB_TOLERANCE = 1e-4
STALENESS = 1
SETTINGS = RolloutSettings(seed=5, prompts_per_micro_batch=4, samples_per_prompt=2,
                           max_new_tokens={"writer": 12, "checker": 12}, temperature={"writer": 1.0, "checker": 1.0})


def _trainer(model_dir: Path) -> PolicyTrainer:
    return PolicyTrainer(str(model_dir), 0, lr=5e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                         num_threads=1)


@pytest.fixture(scope="module")
def policies(tiny_model_dir: Path) -> dict[int, PolicyTrainer]:
    """Version 0 (the model) and version 1 (one large step away, so the two versions' logprobs differ)."""
    old, new = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    prompt, response = [17, 11, 18, 29], [20, 0]
    new.accumulate(TrainBatch([prompt], [response], [old.completion_logprobs(prompt, response)], [1.0]))
    new.apply_step()
    return {0: old, 1: new}


def broadcast_from(replicas: EngineReplicas, trainer: PolicyTrainer) -> None:
    """Sync the trainer's version into the replicas by broadcast, the trainer's side on a thread (as its actor's
    concurrency group runs it); a replica restarted later loads the trainer's staged copy."""
    import ray

    layout = trainer.stage_weights()
    with ThreadPoolExecutor(1) as pool:
        replicas.broadcast_weights(trainer.weights_address(),
                                   lambda group: pool.submit(trainer.send_weights, group, trainer.version), layout,
                                   trainer.version, lambda version: ray.put(trainer.staged_weights(version)))


@pytest.fixture(scope="module")
def replicas(local_ray, tiny_model_dir: Path):
    actor = engine_actor(EngineConfig(num_cpus=0), actor_class=AsyncRolloutEngine)

    def spawn(replica: int, version: int):
        # Through the kept-actor registry, as a run's replicas are: the tests count what it holds.
        return warm_actors.start(actor, "writer", str(tiny_model_dir), version, gpu_memory_utilization=0.04,
                                 max_model_len=128, dtype="float32", seed=0, threads=1)

    engines = EngineReplicas("writer", [spawn(0, 0), spawn(1, 0)], version=0, spawn=spawn,
                             release=warm_actors.release)
    local_ray.get([h.policy_version.remote() for h in engines.handles()])
    yield engines
    engines.shutdown()


def _rollout_in_background(env, engines: EngineReplicas, key: MicroBatchKey):
    """Start the micro-batch's rollout on a thread; -> (thread, result dict with 'table' or 'error', start time)."""
    result: dict = {}

    def run() -> None:
        try:
            result["table"] = rollout_trajectories(env, {"writer": engines, "checker": engines}, key, SETTINGS,
                                                   RolloutConfig())
        except BaseException as error:  # re-raised by the test
            result["error"] = error

    thread = threading.Thread(target=run)
    started = time.time()
    thread.start()
    return thread, result, started


def _committed(store: ExperienceStore, key: MicroBatchKey, thread: threading.Thread, result: dict, started: float):
    thread.join(timeout=300)
    assert not thread.is_alive(), "the rollout did not finish"
    if "error" in result:
        raise result["error"]
    store.commit("rollouts", key, with_stage_timing(result["table"], started, started, time.time()))
    return store.read("rollouts", key).to_pylist()


def _wait_for_requests(engines: EngineReplicas, replica: int, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while engines.router.outstanding()[replica] == 0:
        assert time.time() < deadline, f"no request reached replica {replica}"
        time.sleep(0.01)


def test_a_weight_update_mid_rollout_records_the_version_that_sampled_each_turn(
        local_ray, replicas: EngineReplicas, policies: dict, tmp_path: Path) -> None:
    key, store = MicroBatchKey("sync", 1, 0), ExperienceStore(tmp_path / "store")
    thread, result, started = _rollout_in_background(TimedReplies(reply_s=0.3), replicas, key)
    _wait_for_requests(replicas, 0)
    time.sleep(0.5)  # some turns done at version 0, others in flight
    sync_started = time.time()
    broadcast_from(replicas, policies[1])
    sync_ended = time.time()
    rows = _committed(store, key, thread, result, started)

    assert len(rows) == 8 * 3 and Counter(r["sample_id"] for r in rows).most_common(1)[0][1] == 1
    assert {r["engine"] for r in rows} == {"writer/0", "writer/1", "checker/0", "checker/1"}
    versions = Counter(r["policy_version"] for r in rows)
    assert set(versions) == {0, 1}, versions  # the update landed mid-rollout
    for row in rows:
        # The staleness bound per turn, from the store: step 1 may use version 0 or 1 with staleness 1.
        assert 0 <= key.step - row["policy_version"] <= STALENESS
        # Sampled wholly by the version it names: no generation spans the update (the reload waits for it).
        expected = policies[row["policy_version"]].completion_logprobs(row["prompt_ids"], row["response_ids"])
        assert row["logprobs"] == pytest.approx(expected, abs=LOGPROB_TOLERANCE), row["sample_id"]
        if row["rollout_start"].timestamp() > sync_ended:
            assert row["policy_version"] == 1
        if row["rollout_end"].timestamp() < sync_started:
            assert row["policy_version"] == 0
        # the environment's reply is timed apart from the sampling (the planner replays it): at least its sleep
        assert 0.3 <= row["observe_seconds"] <= (row["rollout_end"] - row["rollout_start"]).total_seconds()
    by_episode: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["turn"]):
        by_episode.setdefault(row["episode"], []).append(row)
    for turns in by_episode.values():  # versions only move forward within an episode
        assert [t["policy_version"] for t in turns] == sorted(t["policy_version"] for t in turns)
        writer = {t["engine"] for t in turns if t["role"] == "writer"}
        assert len(writer) == 1, writer  # sticky: the writer's second turn on the replica of its first
    assert local_ray.get([h.policy_version.remote() for h in replicas.handles()]) == [1, 1]


def test_a_replica_killed_mid_rollout_loses_and_duplicates_nothing_and_comes_back_at_the_current_version(
        local_ray, replicas: EngineReplicas, policies: dict, tmp_path: Path) -> None:
    if replicas.version != 1:  # run alone: bring the replicas to version 1 first
        broadcast_from(replicas, policies[1])
    key, store = MicroBatchKey("kill", 2, 0), ExperienceStore(tmp_path / "store")
    victim = replicas.handle(0)
    pid = local_ray.get(victim.__ray_call__.remote(lambda self: os.getpid()))
    told = []  # what the orchestrator turns into ReplicaChanged events (the run's log)
    replicas.listener = lambda *change: told.append(change)
    registered = warm_actors.in_use()
    thread, result, started = _rollout_in_background(TimedReplies(reply_s=0.3), replicas, key)
    _wait_for_requests(replicas, 0)
    os.kill(pid, signal.SIGKILL)  # a real fault: the actor's process, not a Ray call
    rows = _committed(store, key, thread, result, started)

    counts = Counter(r["sample_id"] for r in rows)
    assert len(counts) == 8 * 3 and set(counts.values()) == {1}  # every turn of every episode, once
    assert all(r["status"] == "ok" and r["policy_version"] == 1 for r in rows)
    replicas.wait_restarts(timeout=300)
    assert replicas.restart_errors == []
    assert replicas.restarted == [(0, 1)]  # detected through a failed request, which was retried elsewhere
    assert told == [(0, "down", None, ""), (0, "up", 1, "")]
    assert warm_actors.in_use() == registered  # the dead replica released from the registry, its successor in it
    restarted = replicas.handle(0)
    assert restarted is not victim and local_ray.get(restarted.policy_version.remote()) == 1
    sampled = local_ray.get(restarted.generate_one.remote("after", GenerationRequest([17, 11, 18, 29], 0, 8, 1.0)))
    assert sampled.completion.logprobs == pytest.approx(
        policies[1].completion_logprobs([17, 11, 18, 29], sampled.completion.response_ids), abs=LOGPROB_TOLERANCE)


def test_a_replica_set_shrinks_and_grows_and_a_started_replica_serves_the_current_version(
        local_ray, replicas: EngineReplicas, policies: dict, tmp_path: Path) -> None:
    """What the inter-agent split (pipeline.rollout.rebalance_replicas) does to an agent between steps."""
    if replicas.version != 1:  # run alone: bring the replicas to version 1 first
        broadcast_from(replicas, policies[1])
    replicas.wait_restarts(timeout=300)
    store = ExperienceStore(tmp_path / "store")
    told = []
    replicas.listener = lambda *change: told.append(change)
    registered = warm_actors.in_use()
    retired = replicas.handle(1)
    replicas.resize(1)
    assert replicas.active() == 1 and replicas.handle(1) is None
    assert warm_actors.in_use() == registered - 1  # a retired replica leaves the registry
    with pytest.raises(local_ray.exceptions.RayActorError):
        local_ray.get(retired.policy_version.remote())  # killed, not merely unrouted
    key = MicroBatchKey("shrunk", 3, 0)
    rows = _committed(store, key, *_rollout_in_background(TimedReplies(reply_s=0.0), replicas, key))
    assert {r["engine"] for r in rows} == {"writer/0", "checker/0"}

    replicas.resize(2)
    replicas.wait_restarts(timeout=300)
    assert replicas.restart_errors == [] and replicas.active() == 2
    assert told == []  # a planned resize is no failure to report
    assert warm_actors.in_use() == registered
    started = replicas.handle(1)
    assert started is not None and local_ray.get(started.policy_version.remote()) == 1
    key = MicroBatchKey("grown", 3, 1)
    rows = _committed(store, key, *_rollout_in_background(TimedReplies(reply_s=0.0), replicas, key))
    assert {r["engine"] for r in rows} == {"writer/0", "writer/1", "checker/0", "checker/1"}
    for row in rows:  # every turn, on either replica, sampled by version 1
        assert row["policy_version"] == 1
        assert row["logprobs"] == pytest.approx(
            policies[1].completion_logprobs(row["prompt_ids"], row["response_ids"]), abs=LOGPROB_TOLERANCE)
    with pytest.raises(ValueError, match="3 replicas requested; this set holds 1 to 2"):
        replicas.resize(3)
