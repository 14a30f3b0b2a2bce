"""A discrete-event simulation (simpy) of this project's orchestrator running a placement plan's specs.

Not a model of RL pipelines in general: the decisions are the orchestrator's own functions, imported. The
staleness gate and the synchronous step barrier (``run/queues.py``), sticky least-outstanding routing over an
agent's replicas (``inference/router.py``), one publisher per agent syncing its replicas one at a time (each
draining while it loads: a reload waits for the requests in flight), the trainer worker serving swapped agents
(its spec's ``loads``), the threads each spec computes on and the node's cores they share with each other and the
driver process (planner/shared_cores.py), and each hand-off of a micro-batch from stage to stage and to the publishers.
Work is charged from costs fitted to a stored run (planner/costs.py); its episodes are replayed as the workload.

What it leaves out is said in ``Prediction.assumptions``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import simpy

from marl_pipeline.cluster.placement import PlacementPlan
from marl_pipeline.cluster.specs import ActorSpec
from marl_pipeline.config import PipelineConfig
from marl_pipeline.inference.router import EpisodeRoute, Router, rolling_sync
from marl_pipeline.planner.costs import Costs, Turn
from marl_pipeline.planner.replica import Busy, EngineReplica
from marl_pipeline.planner.shared_cores import SerialWork, SharedCores
from marl_pipeline.run.queues import StepBarrier, StepClock, gate_open, learners, sync_due
from marl_pipeline.store import MicroBatchKey

ASSUMPTIONS = (
    "the calibration run's episodes (turns and their token counts) are the workload",
    "each actor keeps its spec's threads (the run moves streaming trainers' threads to follow demand)",
    "a hybrid agent's engine step and trainer call never overlap (one interpreter), whole, not interleaved",
    "swapping an agent's trainer state in and out costs nothing beyond the calls it serves",
    "environment and reward take their calibrated seconds a micro-batch, beside the engines and trainers (the "
    "action pool's workers and their scheduling are not simulated)",
    "a colocated agent's engine sleeping and waking, and replicas moved between agents (rebalancing), cost nothing",
    "a trainer on several workers is its rank 0, charged for the whole trainer",
    "the driver's CPU is charged per turn, on one thread of the first node's cores, as the calibration run spent it "
    "(its commits and stage threads included), with its rollout messages (calls to replicas, chunks of results "
    "back) as many a turn and replica as the calibration run sent, beside the turns: a wave's next turns go out "
    "together, where a busy driver sends them one by one; an environment's reply waits its calibrated seconds, on "
    "no core",
    "a weight sync's calibrated seconds are one thread's work on the engine's cores (the trainer's side of it is "
    "not charged), as measured beside the other agents' syncs",
    "a request's own work in its engine (taken in, its output made and returned) is done on one of the engine's "
    "threads after its step, and the step's results come back together once all of it is done, as the engine "
    "streams them; results that come apart on crowded cores are not simulated",
)


@dataclass(frozen=True)
class Decision:
    """One simulated turn: which replica served it, at which policy version, and when."""

    step: int
    micro_batch: int
    episode: int
    turn: int
    agent: str
    replica: int
    version: int
    started: float
    ended: float


@dataclass
class Prediction:
    """What the simulation predicts for the plan: step times, each actor's busy share, staleness, the bound."""

    step_seconds: list[float]
    """Per step, as ``StepFinished.seconds`` reports it: since the previous step finished (the first: since its
    first rollout started)."""
    busy: dict[str, float]
    """Per actor (spec name) and stage: the share of the simulated time it was computing."""
    staleness: dict[int, int]
    """Turns sampled at each staleness (step - policy version)."""
    released: dict[int, float]
    """When the staleness gate released each step's rollout."""
    served: dict[str, dict[int, float]] = field(default_factory=dict)
    """When each agent's engines all came to serve each version."""
    decisions: list[Decision] = field(default_factory=list)
    assumptions: tuple[str, ...] = ASSUMPTIONS
    core_seconds: dict[str, float] = field(default_factory=dict)
    """Per kind of work (``engines``, ``trainers``, ``driver``): the nodes' core-seconds charged a step, on average
    over the simulated steps (a GPU's device-seconds are not counted)."""

    @property
    def mean_step_seconds(self) -> float:
        return sum(self.step_seconds) / len(self.step_seconds)

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.mean_step_seconds

    @property
    def bound(self) -> str:
        """The busiest actor or stage: what the step waits on most."""
        return max(self.busy, key=self.busy.get)


class _Simulation:
    def __init__(self, plan: PlacementPlan, pipeline: PipelineConfig, costs: Costs,
                 nodes: list[dict[str, float]], steps: int, staleness: dict[str, int] | None = None,
                 sync_every: dict[str, int] | None = None) -> None:
        self.env = env = simpy.Environment()
        self.plan, self.pipeline, self.costs, self.steps = plan, pipeline, costs, steps
        self.busy: dict[str, Busy] = defaultdict(lambda: Busy(env))
        self.synchronous = pipeline.mode == "synchronous"
        self.agents = list(plan.engine_sets)
        self.staleness = staleness or dict.fromkeys(self.agents, pipeline.staleness_bound())
        self.sync_every = {agent: (sync_every or {}).get(agent, 1) for agent in self.agents}
        self.served = dict.fromkeys(self.agents, 0)
        self.served_at: dict[str, dict[int, float]] = {agent: {0: 0.0} for agent in self.agents}
        self.committed = dict.fromkeys(self.agents, 0)
        self.served_changed = env.event()
        self.cores, self.nodes = _place(plan, nodes, env, costs.threads.crowding)
        self.driver = SerialWork(self.nodes[0], self.busy["driver"])  # one interpreter: a thread of the head's cores
        self.hybrid = {spec.agent for spec in plan.specs if spec.role == "agent-process"}
        self._interpreters: dict[str, simpy.Resource] = {}
        self.engines = {agent: [self._replica(spec, costs) for spec in plan.agent_specs(agent, "engine")]
                        for agent in self.agents}
        self.routers = {agent: Router(len(replicas), plan.engine_sets[agent].max_outstanding)
                        for agent, replicas in self.engines.items()}
        self.released_replica = {agent: env.event() for agent in self.agents}
        self.trainer_of, self.trainer_lock = {}, {}
        for spec in plan.specs:  # the actor that runs each agent's trainer calls, one at a time
            if spec.role in ("trainer", "agent-process", "trainer-worker") and spec.index == 0:
                lock = simpy.Resource(env, 1)
                trainer = spec.parts[1] if spec.parts else spec
                cores, device = self.cores[spec.name]
                for agent in spec.loads:
                    self.trainer_of[agent] = trainer
                    self.trainer_lock[agent] = (lock, cores, 1 if device else trainer.threads)
        self.decisions: list[Decision] = []
        self.tokens: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: dict.fromkeys(self.agents, 0))
        self.released: dict[int, float] = {}
        self.step_seconds: list[float] = []
        self.clock = StepClock()  # the orchestrator's: each step from the previous one's end
        self.episode_counter = 0
        self.driver_per_turn = {agent: costs.driver_per_turn + costs.driver_per_message * costs.messages_per_turn
                                * len(replicas) for agent, replicas in self.engines.items()}  # planner/cpu.py

    # -- the recipe: the orchestrator's threads as processes --------------------------------------
    def run(self) -> Prediction:
        env, pipeline = self.env, self.pipeline
        size = pipeline.queue_capacity()
        boxes = [simpy.Store(env, size) for _ in range(3)]
        env.process(self._source(boxes[0]))
        for index, (stage, workers, seconds) in enumerate(
                (("environment_results", pipeline.environment_concurrency, self.costs.environment),
                 ("rewards", pipeline.reward_concurrency, self.costs.reward)), start=1):
            barrier = StepBarrier(pipeline.micro_batches_per_step, self.synchronous)
            for _ in range(workers):
                env.process(self._map(stage, seconds, boxes[index - 1], boxes[index], barrier))
        publish = {agent: simpy.Store(env) for agent in self.agents}
        env.process(self._train(boxes[2], publish))
        done = [env.process(self._publish(agent, publish[agent])) for agent in self.agents]
        env.run(until=simpy.AllOf(env, done))
        elapsed = env.now or 1.0
        staleness: dict[int, int] = defaultdict(int)
        for decision in self.decisions:
            staleness[decision.step - decision.version] += 1
        charged: dict[str, float] = defaultdict(float)
        for node in self.nodes:
            for kind, seconds in node.by_kind.items():
                charged[kind] += seconds / self.steps
        return Prediction(self.step_seconds, {name: busy.total / elapsed for name, busy in self.busy.items()},
                          dict(staleness), self.released, self.served_at, self.decisions,
                          (*ASSUMPTIONS[:2], self.costs.threads.describe(), *ASSUMPTIONS[2:]), dict(charged))

    def _source(self, outbox: simpy.Store):
        barrier = StepBarrier(self.pipeline.micro_batches_per_step, self.synchronous)
        for step in range(self.steps):
            while not gate_open(self.served, step, self.staleness):
                yield self.served_changed
            self.released[step] = self.clock.start(step, self.env.now)
            for mb in range(self.pipeline.micro_batches_per_step):
                self.busy["rollouts"].start()
                yield self.env.process(self._rollout(step, mb))
                yield self.env.timeout(self.costs.rollout_overhead)
                self.busy["rollouts"].stop()
                for ready in barrier.add(MicroBatchKey(self.plan.run, step, mb)):
                    yield outbox.put(ready)

    def _rollout(self, step: int, mb: int):
        count = self.pipeline.prompts_per_micro_batch * self.pipeline.samples_per_prompt
        episodes = []
        for e in range(count):
            turns = self.costs.episodes[self.episode_counter % len(self.costs.episodes)]
            self.episode_counter += 1
            episodes.append(self.env.process(self._episode(step, mb, e, turns)))
        yield simpy.AllOf(self.env, episodes)

    def _episode(self, step: int, mb: int, e: int, turns: list[Turn]):
        route = EpisodeRoute((step, mb, e), self.pipeline.rollout.lanes)
        for index, turn in enumerate(turns):
            router = self.routers[turn.agent]
            while (replica := route.acquire(router)) is None:  # every replica saturated: wait for a release
                yield self.released_replica[turn.agent]
            started = self.env.now
            engine = self.engines[turn.agent][replica]
            self.driver.add(self.driver_per_turn[turn.agent])  # beside the turn, not before it
            version = yield engine.generate(turn, index)
            route.release(router, replica)
            waiting, self.released_replica[turn.agent] = self.released_replica[turn.agent], self.env.event()
            waiting.succeed()
            self.decisions.append(Decision(step, mb, e, index, turn.agent, replica, version, started, self.env.now))
            self.tokens[(step, mb)][turn.agent] += turn.prompt_tokens + turn.response_tokens
            if turn.observe_seconds:  # the environment's reply, before the episode's next turn
                yield self.env.timeout(turn.observe_seconds)
        route.end(self.routers.values())

    def _map(self, stage: str, seconds: float, inbox: simpy.Store, outbox: simpy.Store, barrier: StepBarrier):
        while True:
            key = yield inbox.get()
            yield self.env.timeout(self.costs.handoff)
            self.busy[stage].start()
            yield self.env.timeout(seconds)
            self.busy[stage].stop()
            for ready in barrier.add(key):
                yield outbox.put(ready)

    def _train(self, inbox: simpy.Store, publish: dict[str, simpy.Store]):
        version = dict.fromkeys(self.agents, 0)
        arrived: set = set()
        for step in range(self.steps):
            learning = learners(version, step)
            for mb in range(self.pipeline.micro_batches_per_step):
                key = MicroBatchKey(self.plan.run, step, mb)
                while key not in arrived:
                    arrived.add((yield inbox.get()))
                arrived.discard(key)
                yield self.env.timeout(self.costs.handoff)
                tokens = self.tokens[(step, mb)]
                self.busy["policy_updates"].start()
                yield simpy.AllOf(self.env, [self.env.process(self._trainer_call(agent, tokens[agent]))
                                             for agent in learning])
                yield self.env.timeout(self.costs.train_overhead)
                self.busy["policy_updates"].stop()
            for agent in learning:
                publish[agent].put(step)
                version[agent] = step + 1
        for box in publish.values():
            box.put(None)

    def _trainer_call(self, agent: str, tokens: int):
        lock, cores, threads = self.trainer_lock[agent]
        costs, spec = self.costs.trainers[agent], self.trainer_of[agent]
        with lock.request() as turn:
            yield turn
            self.busy[spec.name].start()
            with self.interpreter(agent, replica=0).request() as held:
                yield held
                yield cores.compute(costs.call + costs.per_token * tokens, threads, "trainers",
                                    self.costs.threads.speedup(threads))
            self.busy[spec.name].stop()

    def _publish(self, agent: str, inbox: simpy.Store):
        """As the orchestrator's publisher: the optimizer step on the trainer (in order with its training calls; the
        engines load the exported weights without it), the replicas synced one at a time (each draining), the
        version served (the gate may open), the commit once the trainer's save is done."""
        costs, spec = self.costs.trainers[agent], self.trainer_of[agent]
        lock, *_ = self.trainer_lock[agent]
        while (step := (yield inbox.get())) is not None:
            yield self.env.timeout(self.costs.handoff)
            with lock.request() as turn:
                yield turn
                self.busy[spec.name].start()
                yield self.env.timeout(costs.apply)
                self.busy[spec.name].stop()
            if sync_due(step + 1, self.sync_every[agent], self.steps):  # else the engines keep their version
                engines = self.engines[agent]
                for replica in rolling_sync(self.routers[agent], range(len(engines))):  # the others serving
                    yield engines[replica].sync(costs.sync_per_replica, step + 1)
                self.served[agent] = step + 1
                self.served_at[agent][step + 1] = self.env.now
                self._served_changed()
            yield self.env.timeout(costs.commit)  # the save the trainer ran meanwhile, the commit after it
            self.committed[agent] = step + 1
            if min(self.committed.values()) > step and len(self.step_seconds) == step:
                self.step_seconds.append(self.clock.finish(step, self.env.now)[0])

    def _replica(self, spec: ActorSpec, costs: Costs) -> EngineReplica:
        """An engine spec's replica: a hybrid agent's engine part, on the cores the plan put its process on."""
        engine = spec.parts[0] if spec.parts else spec
        return EngineReplica(self.env, engine, costs.engines[engine.agent], self.cores[spec.name],
                             self.busy[engine.name], self.interpreter(engine.agent, replica=engine.index))

    def interpreter(self, agent: str, replica: int) -> simpy.Resource:
        """The interpreter a hybrid agent's replica 0 and trainer share (their Python runs one at a time: a
        trainer call and an engine step do not overlap); any other actor has its own."""
        if replica == 0 and agent in self.hybrid:
            return self._interpreters.setdefault(agent, simpy.Resource(self.env, 1))
        return simpy.Resource(self.env, 1)

    def _served_changed(self) -> None:
        changed, self.served_changed = self.served_changed, self.env.event()
        changed.succeed()


def _place(plan: PlacementPlan, nodes: list[dict[str, float]], env: simpy.Environment,
           crowding: float = 0.0) -> tuple[dict[str, tuple[SharedCores, bool]], list[SharedCores]]:
    """Where each spec computes: an actor on GPUs on a device of its own (one a placement group: a colocated agent's
    engine and trainer share theirs), whose costs are device-seconds; any other on the cores of the node the plan
    put it on, whose costs are core-seconds. With whether it is a device (a job there runs on one thread); and the
    nodes' cores, the first's where the driver runs (Ray's head); ``crowding``: the nodes' (planner/shared_cores.py)."""
    shared = [SharedCores(env, node.get("CPU", 1.0), crowding) for node in nodes]
    devices: dict[str, SharedCores] = {}
    placed = {}
    for spec in plan.specs:
        on_gpus = spec.gpus > 0 or (spec.group is not None and any(b.get("GPU", 0) for b in spec.group.bundles))
        if on_gpus:
            key = spec.group.name if spec.group is not None and spec.group.kind == "colocated" else spec.name
            placed[spec.name] = (devices.setdefault(key, SharedCores(env, 1.0)), True)
        else:  # a hybrid agent's process is where the plan put its engine
            placed[spec.name] = (shared[plan.node_of[(spec.parts[0] if spec.parts else spec).name]], False)
    return placed, shared


def simulate(plan: PlacementPlan, pipeline: PipelineConfig, costs: Costs, nodes: list[dict[str, float]],
             steps: int | None = None, staleness: dict[str, int] | None = None,
             sync_every: dict[str, int] | None = None) -> Prediction:
    """Simulate ``steps`` steps (default ``pipeline.steps``) of the plan's actors on ``nodes`` (each node's
    resources, as the plan was made on them) with ``costs``; ``staleness``: each agent's bound
    (``ExperimentConfig.staleness_bounds``; default: the pipeline's for all); ``sync_every``: each agent's
    ``agents.<a>.sync_every`` (default 1: its engines load every version)."""
    simulation = _Simulation(plan, pipeline, costs, nodes, steps or pipeline.steps, staleness, sync_every)
    return simulation.run()
