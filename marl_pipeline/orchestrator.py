"""The joint orchestrator: micro-batches flow rollout -> environment -> reward -> train.

Each stage is a group of threads around one stage function; bounded queues between groups give
backpressure (rollout never runs more than ``queue_size`` micro-batches ahead of the next stage).
Only micro-batch keys travel on the queues: the data goes through the store.

- Streaming (default): rollout of micro-batch k+1 overlaps the later stages of micro-batch k.
  Rollout of step i waits until every agent's engine serves a version v with i - v <= staleness:
  with staleness 0 each step's update is the synchronous one; with staleness >= 1 rollout of the
  next steps overlaps training.
- Synchronous: the same threads, with a barrier after each stage for the whole step.

Agents step independently: after a step's last micro-batch, each agent's optimizer step, weight
sync into its engine and checkpoint run on that agent's own publisher thread.

Exactly-once: a committed partition is never recomputed (a resumed launch skips it); the trainer of
an agent that has not yet stepped past a step re-accumulates that step's committed micro-batches
from the store, since gradients are not checkpointed.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa
import ray

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import Environment
from marl_pipeline.execution import execute_micro_batch
from marl_pipeline.launches import LaunchPlan
from marl_pipeline.reward import score_micro_batch
from marl_pipeline.reward_model import model_reward
from marl_pipeline.rollout import RolloutSettings, rollout_micro_batch
from marl_pipeline.schema import with_stage_timing
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.training import train_micro_batch
from marl_pipeline.workers import Workers


@dataclass(frozen=True)
class StageTiming:
    """Wall-clock facts of one stage of one micro-batch (epoch seconds)."""

    enqueued: float
    """When the micro-batch became ready for the stage (its inputs committed, or the gate opened)."""
    started: float
    ended: float
    """When its output was committed."""


@dataclass(frozen=True)
class StageCommitted:
    """A stage's output for one micro-batch is committed to the store."""

    stage: str
    key: MicroBatchKey
    path: Path
    timing: StageTiming
    table: pa.Table = field(repr=False)

    @property
    def seconds(self) -> float:
        return self.timing.ended - self.timing.started


@dataclass(frozen=True)
class PolicyCommitted:
    """A new policy version of one agent is trained, synced into its engine and saved."""

    agent: str
    version: int
    step: int
    path: Path
    grad_norm: float
    tokens: int
    timing: StageTiming


@dataclass(frozen=True)
class StepFinished:
    """Every agent has stepped past ``step``: its reward summary, for progress displays."""

    step: int
    mean_reward: dict[str, float]
    seconds: float


Event = StageCommitted | PolicyCommitted | StepFinished
_DONE = object()


class Orchestrator:
    """Drives the steps of one launch through the stage functions on Ray."""

    def __init__(self, config: ExperimentConfig, env: Environment, store: ExperienceStore, workers: Workers,
                 plan: LaunchPlan) -> None:
        self.config, self.env, self.store, self.workers, self.plan = config, env, store, workers, plan
        pipeline, algorithm = config.pipeline, config.algorithm
        self.micro_batches = pipeline.micro_batches_per_step
        self.staleness = 0 if pipeline.mode == "synchronous" else pipeline.staleness
        self.rollout_settings = RolloutSettings(config.seed, pipeline.prompts_per_micro_batch,
                                                pipeline.samples_per_prompt, algorithm.max_new_tokens,
                                                algorithm.temperature)
        pool, settings = workers.reward_pool, config.reward_model
        self._model_reward = model_reward(settings, pool) if pool is not None and settings is not None else None
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._served = dict(plan.versions)  # per agent: the version its engine serves
        self._served_changed = threading.Condition()
        self._ready_at: dict[tuple[str, MicroBatchKey], float] = {}
        self._step_started: dict[int, float] = {}

    # -- the recipe -------------------------------------------------------------------------------
    def run(self) -> Iterator[Event]:
        """Run every step of the launch; yields events as commits land. Raises the first stage error."""
        pipeline = self.config.pipeline
        size = max(pipeline.queue_size, self.micro_batches if pipeline.mode == "synchronous" else 1)
        to_env, to_reward, to_train = queue.Queue(size), queue.Queue(size), queue.Queue(size)
        publish = {agent: queue.Queue() for agent in self.config.agents}
        synchronous = pipeline.mode == "synchronous"
        groups = [
            self._spawn("rollout", 1, self._rollout_loop, None, to_env, pipeline.environment_concurrency,
                        _StepBarrier(self.micro_batches, synchronous)),
            self._spawn("environment", pipeline.environment_concurrency, self._map_loop, to_env, to_reward,
                        pipeline.reward_concurrency, "environment_results", self._environment, "rewards",
                        _StepBarrier(self.micro_batches, synchronous)),
            self._spawn("reward", pipeline.reward_concurrency, self._map_loop, to_reward, to_train, 1,
                        "rewards", self._reward, "policy_updates", _StepBarrier(self.micro_batches, synchronous)),
            self._spawn("train", 1, self._train_loop, to_train, None, 0, publish),
            *(self._spawn(f"publish-{agent}", 1, self._publish_loop, publish[agent], None, 0, agent)
              for agent in self.config.agents),
        ]
        threads = [thread for group in groups for thread in group]
        finished = 0
        try:
            while finished < len(threads):
                item = self._events.get()
                if item is _DONE:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self._stop.set()
            with self._served_changed:
                self._served_changed.notify_all()
            for thread in threads:
                thread.join(timeout=60)

    def steps(self) -> range:
        return range(self.plan.first_step, self.plan.last_step + 1)

    def keys(self, step: int) -> list[MicroBatchKey]:
        return [MicroBatchKey(self.config.run, step, mb) for mb in range(self.micro_batches)]

    def _rollout_loop(self, _: None, out: queue.Queue, barrier: _StepBarrier) -> None:
        for step in self.steps():
            self._wait_until_served(step - self.staleness)
            self._step_started.setdefault(step, time.time())
            for key in self.keys(step):
                self._ready_at[("rollouts", key)] = time.time()
                self._run_stage("rollouts", key, self._rollout)
                for ready in barrier.add(key):
                    self._put(out, ready, "environment_results")

    def _rollout(self, key: MicroBatchKey) -> pa.Table:
        return rollout_micro_batch(self.env, self.workers.engines, key, self.rollout_settings)

    def _environment(self, key: MicroBatchKey) -> pa.Table:
        return execute_micro_batch(self.env, self.store.read("rollouts", key), pool=self.workers.action_pool)

    def _reward(self, key: MicroBatchKey) -> pa.Table:
        return score_micro_batch(self.env, self.store.read("rollouts", key),
                                 self.store.read("environment_results", key), self.config.algorithm.advantage_eps,
                                 model_reward=self._model_reward)

    def _map_loop(self, inbox: queue.Queue, outbox: queue.Queue, stage: str, work: Callable, next_stage: str,
                  barrier: _StepBarrier) -> None:
        while (key := self._get(inbox)) is not None:
            self._run_stage(stage, key, work)
            for ready in barrier.add(key):
                self._put(outbox, ready, next_stage)

    def _train_loop(self, inbox: queue.Queue, _: None, publish: dict[str, queue.Queue]) -> None:
        """Accumulate micro-batches in (step, micro-batch) order; hand each finished step to the publishers."""
        trainers = self.workers.trainers
        version = dict(self.plan.versions)  # per agent: the version its trainer holds once the issued calls run
        arrived: set[MicroBatchKey] = set()  # keys may arrive out of order when a stage has several workers
        try:
            for step in self.steps():
                learners = [agent for agent in trainers if version[agent] == step]
                for key in self.keys(step):
                    while key not in arrived:
                        if (item := self._get(inbox)) is None:
                            return
                        arrived.add(item)
                    arrived.discard(key)
                    # A committed partition (resumed launch) is not re-committed, but agents still on this
                    # step rebuild its gradient: gradients are not checkpointed.
                    self._run_stage("policy_updates", key,
                                    partial(train_micro_batch, self.store, trainers={a: trainers[a] for a in learners}),
                                    recompute_if_committed=bool(learners))
                for agent in learners:
                    # Issued now, in actor order: the next step's accumulate calls queue behind them.
                    staging = self.store.staging_policy_dir(self.config.run, agent, step + 1)
                    refs = (trainers[agent].apply_step.remote(), trainers[agent].named_weights.remote(),
                            trainers[agent].save.remote(str(staging)))
                    publish[agent].put((step, staging, refs, time.time()))
                    version[agent] = step + 1
        finally:
            for box in publish.values():
                box.put(None)  # end of stream for the publishers

    def _publish_loop(self, inbox: queue.Queue, _: None, agent: str) -> None:
        """One agent's step end: optimizer step result, weight sync into its engine, policy commit."""
        engine = self.workers.engines[agent]
        while (item := self._get(inbox)) is not None:
            step, staging, (applied, weights, saved), enqueued = item
            started = time.time()
            result = ray.get(applied)
            ray.get([engine.load_weights.remote(weights, result["policy_version"]), saved])
            timing = StageTiming(enqueued, started, time.time())
            (staging / "timing.json").write_text(json.dumps({"step": step, **asdict(timing), **result}))
            path = self.store.commit_policy(staging, self.config.run, agent, result["policy_version"])
            self._events.put(PolicyCommitted(agent, result["policy_version"], step, path, result["grad_norm"],
                                             result["tokens"], timing))
            with self._served_changed:
                self._served[agent] = result["policy_version"]
                self._served_changed.notify_all()
                everyone_past = min(self._served.values()) > step
            if everyone_past:
                self._events.put(StepFinished(step, self.step_rewards(step),
                                              time.time() - self._step_started.get(step, started)))

    def step_rewards(self, step: int) -> dict[str, float]:
        """Mean episode reward of each agent over a step's committed micro-batches."""
        tables = [self.store.read("rewards", key, columns=["agent", "reward"]) for key in self.keys(step)]
        table = pa.concat_tables(tables).group_by("agent").aggregate([("reward", "mean")])
        return dict(zip(table.column("agent").to_pylist(), table.column("reward_mean").to_pylist()))

    # -- plumbing ---------------------------------------------------------------------------------
    def _run_stage(self, stage: str, key: MicroBatchKey, compute: Callable[[MicroBatchKey], pa.Table],
                   recompute_if_committed: bool = False) -> None:
        """Compute and commit one stage partition, unless it is already committed (a resumed launch)."""
        if self.store.is_committed(stage, key):
            if recompute_if_committed:
                compute(key)
            return
        enqueued = self._ready_at.pop((stage, key), time.time())
        started = time.time()
        table = compute(key)
        timing = StageTiming(enqueued, started, time.time())
        table = with_stage_timing(table, timing.enqueued, timing.started, timing.ended)
        path = self.store.commit(stage, key, table)
        self._events.put(StageCommitted(stage, key, path, timing, table))

    def _spawn(self, name: str, workers: int, target: Callable, inbox, outbox, downstream_workers: int,
               *args) -> list[threading.Thread]:
        """``workers`` threads running ``target``; the last one to finish ends the stream for the next stage."""
        remaining = [workers]
        lock = threading.Lock()

        def guarded() -> None:
            try:
                target(inbox, outbox, *args)
            except BaseException as error:  # handed to the caller's thread and re-raised there
                error.add_note(f"in the {name} stage of the marl_pipeline orchestrator")
                self._events.put(error)
            finally:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last and outbox is not None:
                    for _ in range(downstream_workers):
                        self._put(outbox, None)
                self._events.put(_DONE)

        threads = [threading.Thread(target=guarded, name=f"marl-{name}-{i}", daemon=True) for i in range(workers)]
        for thread in threads:
            thread.start()
        return threads

    def _put(self, box: queue.Queue, item: MicroBatchKey | None, stage: str | None = None) -> None:
        """Blocking put that gives up when the run stops; records when ``item`` became ready for ``stage``."""
        if stage is not None:
            self._ready_at[(stage, item)] = time.time()
        while not self._stop.is_set():
            try:
                box.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _get(self, box: queue.Queue):
        while not self._stop.is_set():
            try:
                return box.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def _wait_until_served(self, needed: int) -> None:
        with self._served_changed:
            while min(self._served.values()) < needed and not self._stop.is_set():
                self._served_changed.wait(timeout=0.5)


class _StepBarrier:
    """Forwards keys downstream: at once (streaming), or a whole step at a time (synchronous).

    One barrier is shared by all workers of a stage, so a step completes whichever worker finishes last.
    """

    def __init__(self, micro_batches: int, synchronous: bool) -> None:
        self.micro_batches, self.synchronous = micro_batches, synchronous
        self.lock = threading.Lock()
        self.done: dict[int, list[MicroBatchKey]] = defaultdict(list)

    def add(self, key: MicroBatchKey) -> list[MicroBatchKey]:
        if not self.synchronous:
            return [key]
        with self.lock:
            self.done[key.step].append(key)
            if len(self.done[key.step]) < self.micro_batches:
                return []
            return sorted(self.done.pop(key.step))


def mean_reward(rewards: dict[str, float]) -> float:
    """The step reward reported to users: the mean over agents of their mean episode reward."""
    return sum(rewards.values()) / max(len(rewards), 1)
