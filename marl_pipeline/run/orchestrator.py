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
from dataclasses import asdict
from functools import partial

import pyarrow as pa
import ray

from marl_pipeline.cluster.colocation import GpuHandover
from marl_pipeline.cluster.cores import cpu_seconds
from marl_pipeline.cluster.spawn import Workers
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import Environment
from marl_pipeline.inference.router import split_replicas
from marl_pipeline.run.evaluations import EvaluationRounds
from marl_pipeline.run.events import (
    Event,
    PolicyCommitted,
    ReplicaChanged,
    StageCommitted,
    StageTiming,
    StepFinished,
    TrainerPasses,
)
from marl_pipeline.run.launches import LaunchPlan
from marl_pipeline.run.layouts import changed_layouts
from marl_pipeline.run.queues import (
    PendingStep,
    Stage,
    StepBarrier,
    StepClock,
    gate_open,
    get_until_stopped,
    learners,
    put_until_stopped,
    start_threads,
    sync_due,
)
from marl_pipeline.services.figures import commit_step_services
from marl_pipeline.stages import health
from marl_pipeline.stages.evaluation import EvaluationSettings, is_evaluated
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import mean_rewards, model_reward, score_micro_batch
from marl_pipeline.stages.rollout import token_demand
from marl_pipeline.stages.training import train_micro_batch
from marl_pipeline.stages.trajectories import rollout_messages, sample_micro_batch
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from marl_pipeline.store.schema import with_stage_timing

_DONE = object()


class Orchestrator:
    """Drives the steps of one launch through the stage functions on Ray."""

    def __init__(self, config: ExperimentConfig, env: Environment, store: ExperienceStore, workers: Workers,
                 plan: LaunchPlan, layouts: dict[str, int | None] | None = None) -> None:
        self.config, self.env, self.store, self.workers, self.plan = config, env, store, workers, plan
        self.layouts = dict(layouts or {})  # per agent with parallelism_by_length: its entry (run/layouts.py)
        self.relayout: dict[str, int | None] = {}  # agents whose next layout differs: the launch ends at last_step
        self.relayout_lengths: dict[str, int] = {}
        self.last_step = plan.last_step
        self.collapsed: list[str] = []  # health.on_collapse: stop's warnings: the launch ends at last_step
        pipeline = config.pipeline
        self.micro_batches = pipeline.micro_batches_per_step
        self.synchronous = pipeline.mode == "synchronous"
        self.staleness = config.staleness_bounds()  # per agent; the gate holds each to its own
        # Every stage's partitions from rollout to training: what the next stages read back, written behind the
        # stages by a thread of their own (store/recent.py).
        self.recent = RecentCommits(store, 4 * self.micro_batches * (max(self.staleness.values()) + 2), behind=True)
        self._model_reward = model_reward(config, workers.reward_pool)
        self.stages = [
            Stage("rollouts", self._rollout, 1),
            Stage("environment_results", self._environment, pipeline.environment_concurrency),
            Stage("rewards", self._reward, pipeline.reward_concurrency),
        ]
        every = config.evaluation.every
        self.evaluations = (EvaluationRounds(env, store, config.run, config.role_agents(), every, plan.last_step + 1,
                                             EvaluationSettings.from_config(config))
                            if every is not None and is_evaluated(env) else None)
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._served = dict(plan.versions)  # per agent: the version its engine serves
        self._committed = dict(plan.versions)  # per agent: its newest version done (in the store, if due)
        self._broadcast = config.ray.weight_sync == "broadcast"
        self._served_changed = threading.Condition()
        self._ready_at: dict[tuple[str, MicroBatchKey], float] = {}
        self._clock = StepClock()  # when each step's rollout started, when the previous StepFinished was put
        # Per step, per agent stepped here: its trainer's figures of the optimizer step (health's TRAINER_SIGNALS).
        self._trained: dict[int, dict[str, dict[str, float]]] = defaultdict(dict)
        # engine and trainer taking turns on their devices, as the plan the actors were started from says
        self.handover = GpuHandover(workers.placement.handovers if workers.placement else (), workers.engines,
                                    workers.trainers)
        for agent, replicas in workers.engines.items():  # a replica's death and restart, to the caller's log
            replicas.listener = partial(self._replica_changed, agent)

    # -- the recipe -------------------------------------------------------------------------------
    def run(self) -> Iterator[Event]:
        """Run every step of the launch; yields events as commits land. Raises the first stage error."""
        for agent, version in self.plan.versions.items():  # the versions the engines serve now (0 for a new run)
            self._evaluate_if_due(agent, version)
        size = self.config.pipeline.queue_capacity()
        # outboxes[i] carries the keys stages[i] committed to the next stage (the last one's go to training).
        outboxes = [queue.Queue(size) for _ in self.stages]
        consumers = [stage.workers for stage in self.stages[1:]] + [1]
        publish = {agent: queue.Queue() for agent in self.config.agents}
        first = self.stages[0]
        threads = self._spawn(first.name, first.workers, partial(self._source_loop, first, outboxes[0]),
                              outboxes[0], consumers[0])
        for i, stage in enumerate(self.stages[1:], start=1):
            following = self.stages[i + 1].name if i + 1 < len(self.stages) else "policy_updates"
            threads += self._spawn(stage.name, stage.workers,
                                   partial(self._map_loop, stage, outboxes[i - 1], outboxes[i], following,
                                           StepBarrier(self.micro_batches, self.synchronous)),
                                   outboxes[i], consumers[i])
        threads += self._spawn("policy_updates", 1, partial(self._train_loop, outboxes[-1], publish))
        for agent in self.config.agents:
            threads += self._spawn(f"publish-{agent}", 1, partial(self._publish_loop, publish[agent], agent))
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
            self.recent.flush()  # the last commits' events, once written
            while not self._events.empty():
                if isinstance(item := self._events.get(), BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()
            with self._served_changed:
                self._served_changed.notify_all()
            for thread in threads:
                thread.join(timeout=60)
            self.recent.close()  # what the stages committed is written before the launch ends

    def _replica_changed(self, agent: str, replica: int, state: str, version: int | None, detail: str) -> None:
        self._events.put(ReplicaChanged(agent, replica, state, version, detail))

    def steps(self) -> range:
        return range(self.plan.first_step, self.plan.last_step + 1)

    def keys(self, step: int) -> list[MicroBatchKey]:
        return [MicroBatchKey(self.config.run, step, mb) for mb in range(self.micro_batches)]

    def _source_loop(self, stage: Stage, outbox: queue.Queue) -> None:
        """Rollout: each step's micro-batches once the staleness gate opens for the step."""
        barrier = StepBarrier(self.micro_batches, self.synchronous)
        for step in self.steps():
            if not self._wait_until_served(step) or step > self.last_step:
                return  # the run stopped (the gate never opened: this step must not be sampled), or ends before it
            self._clock.start(step, time.time())
            if self.config.pipeline.rollout.rebalance_replicas and step > 0:
                self._rebalance_replicas(step - 1)
            for key in self.keys(step):
                self._ready_at[(stage.name, key)] = time.time()
                if not self._run_stage(stage.name, key, stage.compute):
                    return
                if key.micro_batch == self.micro_batches - 1:
                    self._check_layouts(step)  # before the step's last key goes on: training sees the new last step
                for ready in barrier.add(key):
                    self._put(outbox, ready, self.stages[1].name)
            if self.relayout:
                return  # the next launch samples step + 1 with the new layout

    def _check_layouts(self, step: int) -> None:
        """EARL: end the launch after ``step`` when its rollouts call for another layout of some agent's engine and
        trainer (``parallelism_by_length``); ``recipe.train`` starts the next launch with it."""
        if step < self.last_step:
            self.relayout, self.relayout_lengths = changed_layouts(self.config, self.layouts, self.recent.read,
                                                                   self.keys(step))
            if self.relayout:
                self.last_step = step

    def _rebalance_replicas(self, previous: int) -> None:
        """FlexMARL's inter-agent level: the replica budget split by each agent's tokens in step ``previous``; run
        by the rollout thread between steps, so none of its requests is in flight."""
        tables = [self.recent.read("rollouts", key, columns=["agent", "prompt_ids", "response_ids"])
                  for key in self.keys(previous)]
        demand = token_demand(pa.concat_tables(tables), list(self.config.agents))
        engines = self.workers.engines
        for agent, replicas in sorted(split_replicas(demand, sum(r.active() for r in engines.values())).items(),
                                      key=lambda item: item[1] - engines[item[0]].active()):
            engines[agent].resize(replicas)  # shrinking first: a moved replica's resources are freed before use

    def _rollout(self, key: MicroBatchKey) -> pa.Table:
        return sample_micro_batch(self.env, self.workers.engines, key, self.config, self.workers.action_pool)

    def _environment(self, key: MicroBatchKey) -> pa.Table:
        return execute_micro_batch(self.env, self.recent.read("rollouts", key), pool=self.workers.action_pool)

    def _reward(self, key: MicroBatchKey) -> pa.Table:
        return score_micro_batch(self.env, self.recent.read("rollouts", key),
                                 self.recent.read("environment_results", key), self.config.advantages(),
                                 model_reward=self._model_reward)

    def _map_loop(self, stage: Stage, inbox: queue.Queue, outbox: queue.Queue, next_stage: str,
                  barrier: StepBarrier) -> None:
        while (key := self._get(inbox)) is not None:
            if not self._run_stage(stage.name, key, stage.compute):
                return
            for ready in barrier.add(key):
                self._put(outbox, ready, next_stage)

    def _train_loop(self, inbox: queue.Queue, publish: dict[str, queue.Queue]) -> None:
        """Accumulate micro-batches in (step, micro-batch) order; hand each finished step to the publishers."""
        trainers = self.workers.trainers
        version = dict(self.plan.versions)  # per agent: the version its trainer holds once the issued calls run
        arrived: set[MicroBatchKey] = set()  # keys may arrive out of order when a stage has several workers
        told: set[str] = set()  # agents whose trainer's pass settings were asked for
        try:
            for step in self.steps():
                if step > self.last_step:  # the launch ends early: a new layout, or a collapse (health.on_collapse)
                    while self._get(inbox) is not None:
                        pass  # what rollout began past it is committed (and trained by the launch that resumes)
                    return
                learning = learners({agent: version[agent] for agent in trainers}, step)
                for key in self.keys(step):
                    while key not in arrived:
                        if (item := self._get(inbox)) is None:
                            return
                        arrived.add(item)
                    arrived.discard(key)
                    if key.micro_batch == 0:  # the step's whole rollout is done (synchronous, for colocated agents)
                        self.handover.to_trainer(learning)
                    # A committed partition (resumed launch) is not re-committed, but agents still on this
                    # step rebuild its gradient: gradients are not checkpointed.
                    if not self._run_stage("policy_updates", key,
                            partial(train_micro_batch, self.recent, trainers={a: trainers[a] for a in learning},
                                    dropping=self.config.dropping_zero_advantage_groups()),
                            recompute_if_committed=bool(learning)):
                        return  # no optimizer step on a partly accumulated gradient
                if step < self.last_step and (found := health.stopping_collapse(self.recent, self.config, step)):
                    self.collapsed, self.last_step = found, step  # this step's versions are the launch's last: saved
                for agent in learning:
                    trainer = trainers[agent]
                    applied = trainer.apply_step.remote()  # issued in actor order: the next step's calls queue behind
                    # Asked now, while a swapped agent's state is loaded: its first pass has sized the budget.
                    settings = trainer.pass_settings.remote() if agent not in told else None
                    told.add(agent)
                    weights = ((trainer.stage_weights if self._broadcast else trainer.named_weights).remote()
                               if self._sync_due(agent, step + 1) else None)
                    saved = (trainer.save_version.remote(step + 1)
                             if self.config.pipeline.checkpoint_due(step, self.last_step) else None)
                    self.handover.to_engine(agent)
                    publish[agent].put(PendingStep(step, applied, weights, saved, time.time(), settings))
                    version[agent] = step + 1
        finally:
            for box in publish.values():
                box.put(None)  # end of stream for the publishers

    def _publish_loop(self, inbox: queue.Queue, agent: str) -> None:
        """One agent's step end: optimizer step result, weight sync into its engine, policy commit."""
        replicas = self.workers.engines[agent]
        while (pending := self._get(inbox)) is not None:
            started = time.time()
            result = ray.get(pending.applied)
            applied = time.time()
            # its engines load the version, or keep theirs where none was exported (agents.<a>.sync_every)
            synced = time.time() if pending.weights is None else self._serve(agent, pending.weights,
                                                                              result.policy_version)
            if pending.settings is not None:  # asked after the step: done once it is
                self._events.put(TrainerPasses(agent, pending.step, ray.get(pending.settings)))
            if pending.saved is not None:
                upload = ray.get(pending.saved)
                timing = StageTiming(pending.enqueued, started, time.time())
                record = json.dumps({"step": pending.step, **asdict(timing), "apply_seconds": applied - started,
                                     "sync_seconds": synced - applied, "served": pending.weights is not None,
                                     "engine_asleep": self.handover.last(agent),
                                     "driver_messages": rollout_messages(), **asdict(result),
                                     **cpu_seconds(replicas.handles(), self.workers.trainers[agent])}).encode()
                self.recent.flush()  # the step's partitions are durable before the version that trained on them
                path = self.store.publish_policy(upload, {"timing.json": record})
                # The newest version is kept (a resumed launch starts from it); evaluations use the engine's copy.
                self.store.prune_policies(self.config.run, agent, self.config.store.retention)
                self._events.put(PolicyCommitted(agent, result.policy_version, pending.step, path, result.grad_norm,
                                                 result.tokens, timing, synced - applied, result.computed_tokens,
                                                 result.tokens_per_second, result.mfu))
            self._trained[pending.step][agent] = health.trainer_signals(result)
            with self._served_changed:  # committed, or stepped past without a checkpoint
                self._committed[agent] = result.policy_version
                everyone_past = min(self._committed.values()) > pending.step
            if everyone_past:
                self._events.put(self._step_finished(pending.step, started))

    def _serve(self, agent: str, weights: ray.ObjectRef, version: int) -> float:
        """``agent``'s engines load ``version``, one replica at a time (the others keep serving; the trainer saves the
        version meanwhile), are evaluated at it if due, and rollout may then sample from it; its checkpoint (if due)
        is committed after. A launch killed before resumes from an older version, retraining from the committed
        partitions. Returns when the sync ended (the version's ``sync_seconds`` stop there, before an evaluation)."""
        if self.evaluations is not None:  # the team may still be measured at the version the engine serves
            self.evaluations.wait_until_measured(self._served[agent], self._stop.is_set)
        self.workers.engines[agent].sync_from(self.workers.trainers[agent], weights, version, self._broadcast)
        synced = time.time()
        self._evaluate_if_due(agent, version)  # before rollout can ask this engine for more
        with self._served_changed:
            self._served[agent] = version
            self._served_changed.notify_all()
        return synced

    def _sync_due(self, agent: str, version: int) -> bool:
        """Whether ``agent``'s engines load ``version``: every ``sync_every`` versions, and the versions evaluated
        or ending the launch."""
        return (sync_due(version, self.config.agents[agent].sync_every, self.last_step + 1)
                or (self.evaluations is not None and self.evaluations.due(version)))

    def _step_finished(self, step: int, fallback_start: float) -> StepFinished:
        with self._served_changed:  # publishers of several agents may finish steps at once
            since, span = self._clock.finish(step, now := time.time(), fallback_start)
        versions = {agent: step + 1 for agent in self.config.agents}  # step s makes version s + 1
        signals = health.commit_step_health(self.recent, self.config.run, step, versions, self._trained.pop(step, {}),
                                            self.micro_batches, now)
        services = commit_step_services(self.recent, self.config.run, step, self.workers.services)
        self.recent.flush()  # the collapse check reads the store's health partitions
        return StepFinished(step, mean_rewards(self.recent, self.keys(step)), since, span,
                            health.signals_by_agent(signals),
                            health.stored_collapse(self.store, self.config.run, step, self.config.health), services)

    def _evaluate_if_due(self, agent: str, version: int) -> None:
        if self.evaluations is not None and self.evaluations.due(version):
            if (committed := self.evaluations.evaluate(agent, self.workers.engines, version)) is not None:
                self._events.put(committed)

    # -- plumbing ---------------------------------------------------------------------------------
    def _run_stage(self, stage: str, key: MicroBatchKey, compute: Callable[[MicroBatchKey], pa.Table],
                   recompute_if_committed: bool = False) -> bool:
        """Compute and commit one stage partition, unless it is already committed (a resumed launch).

        False, doing nothing, once the run has stopped: an error elsewhere stops the run, and its threads must not
        start new work while they wind down (rollout released from a staleness gate would sample with the old
        policy and commit it, breaking the bound for the relaunch that resumes from the store)."""
        if self._stop.is_set():
            return False
        if self.store.is_committed(stage, key):
            if recompute_if_committed:
                compute(key)
            return True
        enqueued, started, cpu = self._ready_at.pop((stage, key), time.time()), time.time(), time.thread_time()
        table = compute(key)
        timing, cpu = StageTiming(enqueued, started, time.time()), time.thread_time() - cpu
        table = with_stage_timing(table, timing.enqueued, timing.started, timing.ended)
        self.recent.commit(stage, key, table, lambda path, handed: self._events.put(  # once written
            StageCommitted(stage, key, path, timing, table, time.time(), handed, cpu)))
        return True

    def _spawn(self, name: str, workers: int, target: Callable[[], None], outbox: queue.Queue | None = None,
               consumers: int = 0) -> list[threading.Thread]:
        end = partial(self._put, outbox) if outbox is not None else None
        return start_threads(name, workers, target, self._events, _DONE, end, consumers)

    def _put(self, box: queue.Queue, item: MicroBatchKey | None, stage: str | None = None) -> None:
        """Blocking put that gives up when the run stops; records when ``item`` became ready for ``stage``."""
        if stage is not None:
            self._ready_at[(stage, item)] = time.time()
        put_until_stopped(box, item, self._stop)

    def _get(self, box: queue.Queue):
        return get_until_stopped(box, self._stop)

    def _wait_until_served(self, step: int) -> bool:
        """Wait until the staleness gate opens for ``step``: True, or False when the run stopped."""
        with self._served_changed:
            while not gate_open(self._served, step, self.staleness) and not self._stop.is_set():
                self._served_changed.wait(timeout=0.5)
            return not self._stop.is_set()
