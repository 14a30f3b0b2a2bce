"""The streaming orchestrator: micro-batches flow rollout -> environment -> reward -> train.

One thread per stage, bounded queues between them (backpressure: rollout never runs more than
``queue_size`` micro-batches ahead of the stage after it). Rollout of micro-batch k+1 therefore
overlaps the environment, reward and train stages of micro-batch k. After a step's last micro-batch
is trained, every agent's trainer steps once, the new weights go straight from trainer to engine
through the Ray object store (no restart), and the version is committed to the store.

Staleness gate: rollout of step i waits until every agent's engine serves a version v with
i - v <= staleness (0: strictly on-policy; each step's update is then the synchronous one).

The caller iterates :meth:`Orchestrator.run`, which yields events from the caller's own thread
(so a Dagster op can log them) as soon as each commit lands.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa
import ray

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import Environment
from marl_pipeline.execution import execute_micro_batch
from marl_pipeline.reward import score_micro_batch
from marl_pipeline.rollout import RolloutSettings, rollout_micro_batch
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.training import train_micro_batch
from marl_pipeline.workers import Workers


@dataclass(frozen=True)
class StageCommitted:
    """A stage's output for one micro-batch is committed to the store."""

    stage: str
    key: MicroBatchKey
    path: Path
    seconds: float
    table: pa.Table = field(repr=False)


@dataclass(frozen=True)
class PolicyCommitted:
    """A new policy version of one agent is trained, synced into its engine and saved."""

    agent: str
    version: int
    step: int
    path: Path
    grad_norm: float
    tokens: int


@dataclass(frozen=True)
class StepFinished:
    """Every agent stepped: the step's reward summary, for progress displays."""

    step: int
    mean_reward: dict[str, float]
    seconds: float


Event = StageCommitted | PolicyCommitted | StepFinished
_DONE = object()


class Orchestrator:
    """Drives ``steps`` RL steps of one run, starting at ``first_step``, through the stage functions."""

    def __init__(self, config: ExperimentConfig, env: Environment, store: ExperienceStore, workers: Workers,
                 first_step: int) -> None:
        self.config = config
        self.env = env
        self.store = store
        self.workers = workers
        self.first_step = first_step
        self.steps = range(first_step, first_step + config.pipeline.steps)
        pipeline, algorithm = config.pipeline, config.algorithm
        self.rollout_settings = RolloutSettings(config.seed, pipeline.prompts_per_micro_batch,
                                                pipeline.samples_per_prompt, algorithm.max_new_tokens,
                                                algorithm.temperature)
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._served_version = first_step  # min over agents of the version the engines serve
        self._version_changed = threading.Condition()

    # -- the recipe -------------------------------------------------------------------------------
    def run(self) -> Iterator[Event]:
        """Run every step; yields events as commits land. Raises the first stage error."""
        size = self.config.pipeline.queue_size
        to_env, to_reward, to_train = queue.Queue(size), queue.Queue(size), queue.Queue(size)
        threads = [
            self._spawn("rollout", self._rollout_loop, None, to_env),
            self._spawn("environment", self._map_loop, to_env, to_reward, self._environment),
            self._spawn("reward", self._map_loop, to_reward, to_train, self._reward),
            self._spawn("train", self._train_loop, to_train, None),
        ]
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
            with self._version_changed:
                self._version_changed.notify_all()
            for thread in threads:
                thread.join(timeout=60)

    def _rollout_loop(self, _: None, out: queue.Queue) -> None:
        for step in self.steps:
            self._wait_for_version(step - self.config.pipeline.staleness)
            for mb in range(self.config.pipeline.micro_batches_per_step):
                key = MicroBatchKey(self.config.run, step, mb)
                self._commit("rollouts", key, partial(rollout_micro_batch, self.env, self.workers.engines, key,
                                                      self.rollout_settings))
                self._put(out, key)

    def _environment(self, key: MicroBatchKey) -> None:
        self._commit("environment_results", key,
                     lambda: execute_micro_batch(self.env, self.store.read("rollouts", key)))

    def _reward(self, key: MicroBatchKey) -> None:
        self._commit("rewards", key, lambda: score_micro_batch(
            self.env, self.store.read("rollouts", key), self.store.read("environment_results", key),
            self.config.algorithm.advantage_eps))

    def _train_loop(self, inbox: queue.Queue, _: None) -> None:
        last_mb = self.config.pipeline.micro_batches_per_step - 1
        step_start = time.perf_counter()
        while (key := self._get(inbox)) is not None:
            self._commit("policy_updates", key, partial(train_micro_batch, self.store, key, self.workers.trainers))
            if key.micro_batch == last_mb:
                self._finish_step(key.step, step_start)
                step_start = time.perf_counter()

    def _finish_step(self, step: int, started: float) -> None:
        """Optimizer step of every agent, weight sync into the running engines, policy commit."""
        trainers, engines = self.workers.trainers, self.workers.engines
        results = dict(zip(trainers, ray.get([t.apply_step.remote() for t in trainers.values()])))
        # Weights move trainer -> object store -> engine; the driver only passes the reference.
        ray.get([engines[a].load_weights.remote(trainers[a].named_weights.remote(), results[a]["policy_version"])
                 for a in trainers])
        for agent, result in results.items():
            version = result["policy_version"]
            staging = self.store.staging_policy_dir(self.config.run, agent, version)
            ray.get(trainers[agent].save.remote(str(staging)))
            path = self.store.commit_policy(staging, self.config.run, agent, version)
            self._events.put(PolicyCommitted(agent, version, step, path, result["grad_norm"], result["tokens"]))
        with self._version_changed:
            self._served_version = min(r["policy_version"] for r in results.values())
            self._version_changed.notify_all()
        self._events.put(StepFinished(step, self.step_rewards(step), time.perf_counter() - started))

    def step_rewards(self, step: int) -> dict[str, float]:
        """Mean episode reward of each agent over a step's committed micro-batches."""
        tables = [self.store.read("rewards", MicroBatchKey(self.config.run, step, mb), columns=["agent", "reward"])
                  for mb in range(self.config.pipeline.micro_batches_per_step)]
        table = pa.concat_tables(tables).group_by("agent").aggregate([("reward", "mean")])
        return dict(zip(table.column("agent").to_pylist(), table.column("reward_mean").to_pylist()))

    # -- plumbing ---------------------------------------------------------------------------------
    def _spawn(self, name: str, target, inbox, outbox, *args) -> threading.Thread:
        def guarded() -> None:
            try:
                target(inbox, outbox, *args)
            except BaseException as error:
                error.add_note(f"in the {name} stage of the marl_pipeline orchestrator")
                self._events.put(error)
            finally:
                if outbox is not None:
                    self._put(outbox, None)  # end of stream for the next stage
                self._events.put(_DONE)

        thread = threading.Thread(target=guarded, name=f"marl-{name}", daemon=True)
        thread.start()
        return thread

    def _map_loop(self, inbox: queue.Queue, outbox: queue.Queue, work) -> None:
        while (key := self._get(inbox)) is not None:
            work(key)
            self._put(outbox, key)

    def _commit(self, stage: str, key: MicroBatchKey, compute) -> None:
        started = time.perf_counter()
        table = compute()
        path = self.store.commit(stage, key, table)
        self._events.put(StageCommitted(stage, key, path, time.perf_counter() - started, table))

    def _put(self, box: queue.Queue, key: MicroBatchKey | None) -> None:
        while not self._stop.is_set():
            try:
                box.put(key, timeout=0.2)
                return
            except queue.Full:
                continue

    def _get(self, box: queue.Queue) -> MicroBatchKey | None:
        while not self._stop.is_set():
            try:
                return box.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def _wait_for_version(self, needed: int) -> None:
        with self._version_changed:
            while self._served_version < needed and not self._stop.is_set():
                self._version_changed.wait(timeout=0.5)


def mean_reward(rewards: dict[str, float]) -> float:
    """The step reward reported to users: the mean over agents of their mean episode reward."""
    return sum(rewards.values()) / max(len(rewards), 1)

